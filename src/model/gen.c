/*
 * gen.c - write random-weight deepseek2, qwen3moe, qwen2moe, olmoe and Mixtral models (and deepseek2's dense twins) in the
 * GGUF layout llama.cpp loads. See include/moetax/gen.h for the invariants.
 */
#include "moetax/gen.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moetax/gguf.h"
#include "moetax/model.h"

moetax_status moetax_gen_preset(const char *preset, struct moetax_gen_params *p) {
    /* defaults shared by all presets: DeepSeek-V2-Lite-like routing */
    *p = (struct moetax_gen_params){
        .name = preset,
        .n_ctx = 4096,
        .n_layer_dense_lead = 1,
        .gating_func = 1,
        .expert_weights_scale = 1.0f,
        .rope_freq_base = 10000.0f,
        .rms_eps = 1e-6f,
        .wtype = MOETAX_TYPE_F32,
        .seed = 42,
    };
    if (!strcmp(preset, "tiny") || !strcmp(preset, "tiny-v3")) {
        p->n_vocab = 512;
        p->n_ctx = 512;
        p->n_embd = 64;
        p->n_layer = 3;
        p->n_ff = 128;
        p->n_head = 4;
        p->kv_lora_rank = 32;
        p->n_embd_head_qk_nope = 16;
        p->n_embd_head_qk_rope = 8;
        p->n_embd_head_v = 16;
        p->n_expert = 8;
        p->n_expert_used = 2;
        p->n_expert_shared = 1;
        p->n_ff_exp = 32;
        if (!strcmp(preset, "tiny-v3")) {
            p->q_lora_rank = 48;
            p->n_expert_group = 4;
            p->n_expert_group_used = 2;
            p->gating_func = 2;
            p->exp_probs_b = true;
            p->expert_weights_norm = true;
            p->expert_weights_scale = 2.5f;
            p->rope_yarn_factor = 4.0f;
            p->rope_yarn_orig_ctx = 128;
            p->rope_yarn_log_mul = 0.1f;
        }
        return MOETAX_OK;
    }
    if (!strcmp(preset, "small")) {
        /* the default random model: ~416 M parameters */
        p->n_vocab = 8192;
        p->n_embd = 1024;
        p->n_layer = 8;
        p->n_ff = 2816;
        p->n_head = 16;
        p->kv_lora_rank = 256;
        p->n_embd_head_qk_nope = 64;
        p->n_embd_head_qk_rope = 32;
        p->n_embd_head_v = 64;
        p->n_expert = 64;
        p->n_expert_used = 6;
        p->n_expert_shared = 2;
        p->n_ff_exp = 256;
        return MOETAX_OK;
    }
    if (!strcmp(preset, "bench-v3")) {
        /* DeepSeek-V3 proportions scaled down: ~2.3 G parameters, Q8_0 ~2.5 GB */
        p->n_vocab = 8192;
        p->n_embd = 1024;
        p->n_layer = 12;
        p->n_ff = 2816;
        p->n_head = 16;
        p->q_lora_rank = 384;
        p->kv_lora_rank = 256;
        p->n_embd_head_qk_nope = 64;
        p->n_embd_head_qk_rope = 32;
        p->n_embd_head_v = 64;
        p->n_expert = 256;
        p->n_expert_used = 8;
        p->n_expert_shared = 1;
        p->n_ff_exp = 256;
        p->n_expert_group = 8;
        p->n_expert_group_used = 4;
        p->gating_func = 2;
        p->exp_probs_b = true;
        p->expert_weights_norm = true;
        p->expert_weights_scale = 2.5f;
        p->rope_yarn_factor = 4.0f;
        p->rope_yarn_orig_ctx = 1024;
        p->rope_yarn_log_mul = 0.1f;
        p->wtype = MOETAX_TYPE_Q8_0;
        return MOETAX_OK;
    }
    if (!strcmp(preset, "v2-lite")) {
        /* DeepSeek-V2-Lite's per-layer shapes (MLA 576/512 with rope 64, 64 experts of 1408, top 6, 2
           shared, a dense first layer 10944 wide) on small's vocabulary, with a q LoRA of 512 where
           V2-Lite projects q directly, and 6 layers instead of 27 (--layers 27 for its depth): the
           benchmark shape of issue 18, ~3.0 G parameters; ik_llama.cpp accepts its heads */
        p->n_vocab = 8192;
        p->n_embd = 2048;
        p->n_layer = 6;
        p->n_ff = 10944;
        p->n_head = 16;
        p->q_lora_rank = 512;
        p->kv_lora_rank = 512;
        p->n_embd_head_qk_nope = 128;
        p->n_embd_head_qk_rope = 64;
        p->n_embd_head_v = 128;
        p->n_expert = 64;
        p->n_expert_used = 6;
        p->n_expert_shared = 2;
        p->n_ff_exp = 1408;
        return MOETAX_OK;
    }
    return moetax_error(MOETAX_ERR_ARG, "unknown preset '%s' (expected tiny, tiny-v3, small, bench-v3 or v2-lite)",
                        preset);
}

bool moetax_gen_arch_from_name(const char *name, enum moetax_gen_arch *out) {
    if (!strcmp(name, "deepseek2")) *out = MOETAX_GEN_DEEPSEEK2;
    else if (!strcmp(name, "qwen3moe")) *out = MOETAX_GEN_QWEN3MOE;
    else if (!strcmp(name, "qwen2moe")) *out = MOETAX_GEN_QWEN2MOE;
    else if (!strcmp(name, "olmoe")) *out = MOETAX_GEN_OLMOE;
    else if (!strcmp(name, "mixtral")) *out = MOETAX_GEN_MIXTRAL;
    else return false;
    return true;
}

const char *moetax_gen_arch_name(enum moetax_gen_arch arch) {
    switch (arch) {
    case MOETAX_GEN_QWEN3MOE: return "qwen3moe";
    case MOETAX_GEN_QWEN2MOE: return "qwen2moe";
    case MOETAX_GEN_OLMOE: return "olmoe";
    case MOETAX_GEN_MIXTRAL: return "mixtral";
    default: return "deepseek2";
    }
}

const char *moetax_gen_arch_gguf(enum moetax_gen_arch arch) {
    return arch == MOETAX_GEN_MIXTRAL ? "llama" : moetax_gen_arch_name(arch);
}

const char *moetax_gen_twin_arch_gguf(enum moetax_gen_arch arch) {
    switch (arch) {
    case MOETAX_GEN_QWEN3MOE: return "qwen3";
    case MOETAX_GEN_QWEN2MOE: return "qwen2";
    default: return moetax_gen_arch_gguf(arch); /* deepseek2, olmoe, llama: the same name, no experts */
    }
}

/* The GQA architectures: every layer MoE, no deepseek2-style shared experts (qwen2moe's gated
 * shared expert is n_ff_shexp). */
static bool gen_gqa(enum moetax_gen_arch arch) {
    return arch == MOETAX_GEN_QWEN3MOE || arch == MOETAX_GEN_QWEN2MOE || arch == MOETAX_GEN_OLMOE ||
           arch == MOETAX_GEN_MIXTRAL;
}

/* qwen2moe: Qwen1.5-MoE-A2.7B's proportions (16 heads of 128 = n_embd, no GQA, 60 experts top-4,
 * a shared expert 4 experts wide, eps 1e-6, rope base 1e6) scaled down; tiny has GQA 2:1. */
static moetax_status preset_qwen2moe(const char *preset, struct moetax_gen_params *p) {
    *p = (struct moetax_gen_params){
        .arch = MOETAX_GEN_QWEN2MOE, .name = preset, .n_ctx = 4096, .gating_func = 1, .expert_weights_norm = false,
        .expert_weights_scale = 1.0f, .rope_freq_base = 1000000.0f, .rms_eps = 1e-6f, .wtype = MOETAX_TYPE_F32,
        .seed = 42,
    };
    if (!strcmp(preset, "tiny")) {
        p->n_vocab = 512;
        p->n_ctx = 512;
        p->n_embd = 64;
        p->n_layer = 3;
        p->n_head = 4;
        p->n_head_kv = 2;
        p->n_embd_head = 16;
        p->n_expert = 8;
        p->n_expert_used = 2;
        p->n_ff_exp = 32;
        p->n_ff_shexp = 64;
        return MOETAX_OK;
    }
    if (!strcmp(preset, "small")) {
        p->n_vocab = 8192;
        p->n_embd = 1024;
        p->n_layer = 8;
        p->n_head = 16;
        p->n_head_kv = 16;
        p->n_embd_head = 64;
        p->n_expert = 60;
        p->n_expert_used = 4;
        p->n_ff_exp = 256;
        p->n_ff_shexp = 1024;
        return MOETAX_OK;
    }
    return moetax_error(MOETAX_ERR_ARG, "unknown qwen2moe preset '%s' (expected tiny or small)", preset);
}

/* olmoe: OLMoE-1B-7B's proportions (16 heads of 128, no GQA, 64 experts top-8, experts 1024
 * wide, eps 1e-5, rope base 10000) scaled down. mixtral: Mixtral-8x7B's (32:8 heads of 128,
 * 8 experts top-2 of width 3.5 d, eps 1e-5, rope base 1e6) scaled down. */
static moetax_status preset_olmoe_mixtral(enum moetax_gen_arch arch, const char *preset, struct moetax_gen_params *p) {
    const bool olmoe = arch == MOETAX_GEN_OLMOE;
    *p = (struct moetax_gen_params){
        .arch = arch, .name = preset, .n_ctx = 4096, .gating_func = 1, .expert_weights_norm = !olmoe,
        .expert_weights_scale = 1.0f, .rope_freq_base = olmoe ? 10000.0f : 1000000.0f, .rms_eps = 1e-5f,
        .wtype = MOETAX_TYPE_F32, .seed = 42,
    };
    if (!strcmp(preset, "tiny")) {
        p->n_vocab = 512;
        p->n_ctx = 512;
        p->n_embd = 64;
        p->n_layer = 3;
        p->n_head = 4;
        p->n_head_kv = olmoe ? 4 : 2;
        p->n_embd_head = olmoe ? 0 : 16;
        p->n_expert = 8;
        p->n_expert_used = 2;
        p->n_ff_exp = olmoe ? 32 : 224;
        return MOETAX_OK;
    }
    if (!strcmp(preset, "small")) {
        p->n_vocab = 8192;
        p->n_embd = 1024;
        p->n_layer = 8;
        p->n_head = 16;
        p->n_head_kv = olmoe ? 16 : 4;
        p->n_embd_head = olmoe ? 0 : 64;
        p->n_expert = olmoe ? 64 : 8;
        p->n_expert_used = olmoe ? 8 : 2;
        p->n_ff_exp = olmoe ? 256 : 1792;
        return MOETAX_OK;
    }
    return moetax_error(MOETAX_ERR_ARG, "unknown %s preset '%s' (expected tiny or small)", moetax_gen_arch_name(arch),
                        preset);
}

moetax_status moetax_gen_preset_arch(enum moetax_gen_arch arch, const char *preset, struct moetax_gen_params *p) {
    if (arch == MOETAX_GEN_DEEPSEEK2) return moetax_gen_preset(preset, p);
    if (arch == MOETAX_GEN_OLMOE || arch == MOETAX_GEN_MIXTRAL) return preset_olmoe_mixtral(arch, preset, p);
    if (arch == MOETAX_GEN_QWEN2MOE) return preset_qwen2moe(preset, p);
    /* qwen3moe: Qwen3-30B-A3B's proportions (GQA 32:4 heads of 128, 128 experts top-8) scaled down */
    *p = (struct moetax_gen_params){
        .arch = arch, .name = preset, .n_ctx = 4096, .gating_func = 1, .expert_weights_norm = true,
        .expert_weights_scale = 1.0f, .rope_freq_base = 1000000.0f, .rms_eps = 1e-6f, .wtype = MOETAX_TYPE_F32,
        .seed = 42,
    };
    if (!strcmp(preset, "tiny")) {
        p->n_vocab = 512;
        p->n_ctx = 512;
        p->n_embd = 64;
        p->n_layer = 3;
        p->n_ff = 128;
        p->n_head = 4;
        p->n_head_kv = 2;
        p->n_embd_head = 16;
        p->n_expert = 8;
        p->n_expert_used = 2;
        p->n_ff_exp = 32;
        return MOETAX_OK;
    }
    if (!strcmp(preset, "small")) {
        p->n_vocab = 8192;
        p->n_embd = 1024;
        p->n_layer = 8;
        p->n_ff = 2048;
        p->n_head = 16;
        p->n_head_kv = 4;
        p->n_embd_head = 64;
        p->n_expert = 64;
        p->n_expert_used = 8;
        p->n_ff_exp = 256;
        return MOETAX_OK;
    }
    return moetax_error(MOETAX_ERR_ARG, "unknown qwen3moe preset '%s' (expected tiny or small)", preset);
}

static moetax_status validate_gqa(const struct moetax_gen_params *p) {
#define NEED(cond, ...) do { if (!(cond)) return moetax_error(MOETAX_ERR_ARG, __VA_ARGS__); } while (0)
    const char *an = moetax_gen_arch_name(p->arch);
    if (p->arch == MOETAX_GEN_OLMOE) /* no key_length written: the head dim is n_embd / n_head */
        NEED(p->n_embd % p->n_head == 0 && (p->n_embd_head == 0 || p->n_embd_head == p->n_embd / p->n_head),
             "olmoe: --head-dim %d must be --embd / --heads (%d / %d) (OLMoE files have no key_length)",
             p->n_embd_head, p->n_embd, p->n_head);
    const int hd = p->arch == MOETAX_GEN_OLMOE ? p->n_embd / p->n_head : p->n_embd_head;
    NEED(p->n_head_kv >= 1 && p->n_head % p->n_head_kv == 0, "--heads-kv %d must divide --heads %d", p->n_head_kv,
         p->n_head);
    NEED(hd >= 2 && hd % 2 == 0 && hd <= 1024, "--head-dim %d must be even and in 2..1024", hd);
    NEED(p->n_layer_dense_lead == 0 && p->n_expert_shared == 0 && p->n_expert_group <= 1 && !p->exp_probs_b &&
             !p->fused_gate_up && !p->kv_b_merged && p->q_lora_rank == 0,
         "%s has no leading dense layers, shared experts, expert groups, selection bias, fused gate_up "
         "or MLA layouts here", an);
    if (p->arch == MOETAX_GEN_QWEN2MOE) {
        NEED((int64_t)p->n_head * hd == p->n_embd, "qwen2moe: --heads %d x --head-dim %d must be --embd %d (llama.cpp "
             "binds attn_q and attn_output as {n_embd, n_embd})", p->n_head, hd, p->n_embd);
        NEED(p->n_ff_shexp >= 1, "qwen2moe: --shared-ff %d (the shared expert's width) must be >= 1", p->n_ff_shexp);
        NEED(p->n_ff == 0 || p->n_ff == p->n_ff_shexp, "--ff %d: qwen2moe's feed_forward_length is written as the "
             "shared expert's width (--shared-ff %d)", p->n_ff, p->n_ff_shexp);
    } else {
        NEED(p->n_ff_shexp == 0, "--shared-ff: only qwen2moe has a gated shared expert");
    }
    if (p->arch == MOETAX_GEN_OLMOE)
        NEED(p->gating_func == 1 && !p->expert_weights_norm, "%s routes with softmax, weights not renormalised", an);
    else if (p->arch == MOETAX_GEN_QWEN2MOE) /* --norm: expert_weights_norm = true (norm_topk_prob) */
        NEED(p->gating_func == 1, "%s routes with softmax", an);
    else
        NEED(p->gating_func == 1 && p->expert_weights_norm, "%s routes with softmax and renormalised weights", an);
    NEED(p->rope_yarn_factor == 0, "--yarn-factor: %s files are written without rope scaling", an);
    NEED(p->arch == MOETAX_GEN_QWEN3MOE || p->arch == MOETAX_GEN_QWEN2MOE || p->n_ff == 0 || p->n_ff == p->n_ff_exp,
         "--ff %d: %s experts are feed_forward_length wide, set by --expert-ff (%d)", p->n_ff, an, p->n_ff_exp);
#undef NEED
    return MOETAX_OK;
}

moetax_status moetax_gen_validate(const struct moetax_gen_params *p) {
#define NEED(cond, ...) do { if (!(cond)) return moetax_error(MOETAX_ERR_ARG, __VA_ARGS__); } while (0)
    NEED(p->n_vocab >= 260, "--vocab %d: need at least 260 tokens (256 bytes + BOS/EOS)", p->n_vocab);
    NEED(p->n_embd >= 1 && p->n_embd <= 65536, "--embd %d out of range", p->n_embd);
    NEED(p->n_layer >= 1 && p->n_layer <= 1024, "--layers %d out of range", p->n_layer);
    NEED(p->n_layer_dense_lead >= 0 && p->n_layer_dense_lead <= p->n_layer,
         "--dense-lead %d must be in 0..layers (%d)", p->n_layer_dense_lead, p->n_layer);
    NEED(p->n_ctx >= 1, "--ctx %d must be >= 1", p->n_ctx);
    NEED(p->n_head >= 1, "--heads %d must be >= 1", p->n_head);
    if (gen_gqa(p->arch)) {
        moetax_status qst = validate_gqa(p);
        if (qst) return qst;
    } else {
    NEED(p->kv_lora_rank >= 1, "--kv-lora %d must be >= 1", p->kv_lora_rank);
    NEED(p->q_lora_rank >= 0, "--q-lora %d must be >= 0", p->q_lora_rank);
    NEED(p->n_embd_head_qk_nope >= 1 && p->n_embd_head_v >= 1, "head dims must be >= 1");
    NEED(p->n_embd_head_qk_rope >= 2 && p->n_embd_head_qk_rope % 2 == 0, "--rope-dim %d must be even and >= 2",
         p->n_embd_head_qk_rope);
    }
    bool has_moe = p->n_layer_dense_lead < p->n_layer;
    NEED(p->n_layer_dense_lead == 0 || p->n_ff >= 1, "--ff %d must be >= 1 with leading dense layers", p->n_ff);
    if (has_moe) {
        NEED(p->n_expert >= 1, "--experts %d must be >= 1", p->n_expert);
        NEED(p->n_expert_used >= 1 && p->n_expert_used <= p->n_expert, "--experts-used %d must be in 1..experts (%d)",
             p->n_expert_used, p->n_expert);
        NEED(p->n_expert_shared >= 0, "--shared %d must be >= 0", p->n_expert_shared);
        NEED(p->n_ff_exp >= 1, "--expert-ff %d must be >= 1", p->n_ff_exp);
        if (p->n_expert_group > 1) {
            NEED(p->n_expert % p->n_expert_group == 0, "--groups %d must divide experts (%d)", p->n_expert_group,
                 p->n_expert);
            NEED(p->n_expert / p->n_expert_group >= 2, "each group needs at least 2 experts (group score = top-2 sum)");
            NEED(p->n_expert_group_used >= 1 && p->n_expert_group_used <= p->n_expert_group,
                 "--groups-used %d must be in 1..groups (%d)", p->n_expert_group_used, p->n_expert_group);
            NEED(p->n_expert_group_used * (p->n_expert / p->n_expert_group) >= p->n_expert_used,
                 "groups-used x experts per group (%d) must be >= experts-used (%d)",
                 p->n_expert_group_used * (p->n_expert / p->n_expert_group), p->n_expert_used);
        }
    }
    NEED(p->gating_func == 1 || p->gating_func == 2, "--gating must be softmax (1) or sigmoid (2)");
    NEED(p->rope_yarn_factor == 0 || p->rope_yarn_orig_ctx >= 1, "--yarn-factor needs --yarn-orig-ctx >= 1");
    NEED(isfinite(p->rope_yarn_log_mul) && p->rope_yarn_log_mul >= 0, "--yarn-log-mul must be >= 0");
    /* the float values the file will hold, checked by the loader's own rules (moetax_hparams_check) */
    struct moetax_hparams hp = {
        .n_expert = has_moe ? p->n_expert : 0,
        .expert_weights_scale = p->expert_weights_scale,
        .rms_eps = p->rms_eps,
        .rope_freq_base = p->rope_freq_base,
        .rope_freq_scale = p->rope_yarn_factor != 0 ? 1.0f / p->rope_yarn_factor : 1.0f,
        .rope_ext_factor = p->rope_yarn_factor != 0 ? 1.0f : 0.0f,
        .rope_attn_factor = 1.0f, /* derived by the loader */
        .rope_beta_fast = 32.0f,
        .rope_beta_slow = 1.0f,
        .kq_scale = 1.0f,         /* derived by the loader */
    };
    snprintf(hp.arch, sizeof hp.arch, "%s", moetax_gen_arch_gguf(p->arch));
    if (moetax_hparams_check(&hp, "gen")) { /* an option's fault here, not a file's */
        char msg[512];
        snprintf(msg, sizeof msg, "%s", moetax_last_error());
        return moetax_error(MOETAX_ERR_ARG, "%s (options --eps, --rope-base, --yarn-factor, --scale)", msg);
    }
    NEED(moetax_type_supported(p->wtype),
         "weight type %s is not one of f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, q2_k, q3_k, q4_k, q5_k, q6_k",
         moetax_type_name(p->wtype));
#undef NEED
    return MOETAX_OK;
}

/* ---- the tensor list ------------------------------------------------------- */

enum init_kind { INIT_LINEAR, INIT_NORM, INIT_EMBD, INIT_BIAS, INIT_ROUTER };

struct gen_tensor {
    char name[96];
    uint32_t n_dims;
    int64_t ne[3];
    enum moetax_type type;
    enum init_kind init;
    float std;
};

struct tensor_list {
    struct gen_tensor *t;
    int n, cap;
    const struct moetax_gen_params *p;
};

static moetax_status add(struct tensor_list *l, enum init_kind init, float fan_in, int n_dims, int64_t ne0,
                         int64_t ne1, int64_t ne2, const char *fmt, int layer) {
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 64;
        struct gen_tensor *t = realloc(l->t, sizeof *t * (size_t)cap);
        if (!t) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        l->t = t;
        l->cap = cap;
    }
    struct gen_tensor *t = &l->t[l->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, fmt, layer);
    t->n_dims = (uint32_t)n_dims;
    t->ne[0] = ne0;
    t->ne[1] = ne1;
    t->ne[2] = ne2;
    t->init = init;
    t->std = init == INIT_LINEAR || init == INIT_ROUTER ? 1.0f / sqrtf(fan_in) : init == INIT_EMBD ? 1.0f : 0.05f;
    /* F32: norms, router, biases, 1-D; else the weight type where its blocks fit the rows, as
     * quantize falls back (a k-quant to Q8_0, then F16: moetax_type_fit) */
    enum moetax_type wt = l->p->wtype;
    if (init == INIT_NORM || init == INIT_BIAS || init == INIT_ROUTER || n_dims == 1) wt = MOETAX_TYPE_F32;
    else wt = moetax_type_fit(wt, ne0);
    t->type = wt;
    return MOETAX_OK;
}

static moetax_status build_tensors(const struct moetax_gen_params *p, struct tensor_list *l) {
    const int64_t d = p->n_embd, H = p->n_head, nope = p->n_embd_head_qk_nope, rope = p->n_embd_head_qk_rope;
    const int64_t vh = p->n_embd_head_v, kvl = p->kv_lora_rank, ql = p->q_lora_rank;
    const int64_t E = p->n_expert, F = p->n_ff_exp, Fs = (int64_t)p->n_expert_shared * p->n_ff_exp;
    const int64_t twin_ff = (int64_t)p->n_expert_used * F + Fs + p->n_ff_shexp;
    const int64_t Hkv = p->n_head_kv;
    const bool qwen = gen_gqa(p->arch); /* GQA: qwen3moe, olmoe, mixtral */
    const int64_t hd = p->arch == MOETAX_GEN_OLMOE ? p->n_embd / p->n_head : p->n_embd_head;
    moetax_status st = MOETAX_OK;
#define ADD(...) do { if ((st = add(l, __VA_ARGS__))) return st; } while (0)
    ADD(INIT_EMBD, 1, 2, d, p->n_vocab, 1, "token_embd.weight", 0);
    for (int il = 0; il < p->n_layer; il++) {
        ADD(INIT_NORM, 1, 1, d, 1, 1, "blk.%d.attn_norm.weight", il);
        if (qwen) { /* GQA: q/k norms per head (qwen3moe), full width (olmoe) or none (mixtral) */
            ADD(INIT_LINEAR, (float)d, 2, d, H * hd, 1, "blk.%d.attn_q.weight", il);
            ADD(INIT_LINEAR, (float)d, 2, d, Hkv * hd, 1, "blk.%d.attn_k.weight", il);
            ADD(INIT_LINEAR, (float)d, 2, d, Hkv * hd, 1, "blk.%d.attn_v.weight", il);
            if (p->arch == MOETAX_GEN_QWEN2MOE) {
                ADD(INIT_BIAS, 1, 1, H * hd, 1, 1, "blk.%d.attn_q.bias", il);
                ADD(INIT_BIAS, 1, 1, Hkv * hd, 1, 1, "blk.%d.attn_k.bias", il);
                ADD(INIT_BIAS, 1, 1, Hkv * hd, 1, 1, "blk.%d.attn_v.bias", il);
            }
            ADD(INIT_LINEAR, (float)(H * hd), 2, H * hd, d, 1, "blk.%d.attn_output.weight", il);
            if (p->arch == MOETAX_GEN_QWEN3MOE) {
                ADD(INIT_NORM, 1, 1, hd, 1, 1, "blk.%d.attn_q_norm.weight", il);
                ADD(INIT_NORM, 1, 1, hd, 1, 1, "blk.%d.attn_k_norm.weight", il);
            } else if (p->arch == MOETAX_GEN_OLMOE) {
                ADD(INIT_NORM, 1, 1, H * hd, 1, 1, "blk.%d.attn_q_norm.weight", il);
                ADD(INIT_NORM, 1, 1, Hkv * hd, 1, 1, "blk.%d.attn_k_norm.weight", il);
            }
        } else if (ql > 0) {
            ADD(INIT_LINEAR, (float)d, 2, d, ql, 1, "blk.%d.attn_q_a.weight", il);
            ADD(INIT_NORM, 1, 1, ql, 1, 1, "blk.%d.attn_q_a_norm.weight", il);
            ADD(INIT_LINEAR, (float)ql, 2, ql, H * (nope + rope), 1, "blk.%d.attn_q_b.weight", il);
        } else {
            ADD(INIT_LINEAR, (float)d, 2, d, H * (nope + rope), 1, "blk.%d.attn_q.weight", il);
        }
        if (!qwen) {
        ADD(INIT_LINEAR, (float)d, 2, d, kvl + rope, 1, "blk.%d.attn_kv_a_mqa.weight", il);
        ADD(INIT_NORM, 1, 1, kvl, 1, 1, "blk.%d.attn_kv_a_norm.weight", il);
        if (p->kv_b_merged) {
            ADD(INIT_LINEAR, (float)kvl, 2, kvl, H * (nope + vh), 1, "blk.%d.attn_kv_b.weight", il);
        } else {
            ADD(INIT_LINEAR, (float)nope, 3, nope, kvl, H, "blk.%d.attn_k_b.weight", il);
            ADD(INIT_LINEAR, (float)kvl, 3, kvl, vh, H, "blk.%d.attn_v_b.weight", il);
        }
        ADD(INIT_LINEAR, (float)(H * vh), 2, H * vh, d, 1, "blk.%d.attn_output.weight", il);
        }
        ADD(INIT_NORM, 1, 1, d, 1, 1, "blk.%d.ffn_norm.weight", il);
        if (il < p->n_layer_dense_lead || p->dense_twin) {
            int64_t ff = il < p->n_layer_dense_lead ? p->n_ff : twin_ff;
            ADD(INIT_LINEAR, (float)d, 2, d, ff, 1, "blk.%d.ffn_gate.weight", il);
            ADD(INIT_LINEAR, (float)d, 2, d, ff, 1, "blk.%d.ffn_up.weight", il);
            ADD(INIT_LINEAR, (float)ff, 2, ff, d, 1, "blk.%d.ffn_down.weight", il);
            continue;
        }
        ADD(INIT_ROUTER, (float)d, 2, d, E, 1, "blk.%d.ffn_gate_inp.weight", il);
        if (p->exp_probs_b) ADD(INIT_BIAS, 1, 1, E, 1, 1, "blk.%d.exp_probs_b.bias", il);
        if (p->fused_gate_up) {
            ADD(INIT_LINEAR, (float)d, 3, d, 2 * F, E, "blk.%d.ffn_gate_up_exps.weight", il);
        } else {
            ADD(INIT_LINEAR, (float)d, 3, d, F, E, "blk.%d.ffn_gate_exps.weight", il);
            ADD(INIT_LINEAR, (float)d, 3, d, F, E, "blk.%d.ffn_up_exps.weight", il);
        }
        ADD(INIT_LINEAR, (float)F, 3, F, d, E, "blk.%d.ffn_down_exps.weight", il);
        if (p->arch == MOETAX_GEN_QWEN2MOE) {
            const int64_t Fq = p->n_ff_shexp;
            ADD(INIT_ROUTER, (float)d, 1, d, 1, 1, "blk.%d.ffn_gate_inp_shexp.weight", il);
            ADD(INIT_LINEAR, (float)d, 2, d, Fq, 1, "blk.%d.ffn_gate_shexp.weight", il);
            ADD(INIT_LINEAR, (float)d, 2, d, Fq, 1, "blk.%d.ffn_up_shexp.weight", il);
            ADD(INIT_LINEAR, (float)Fq, 2, Fq, d, 1, "blk.%d.ffn_down_shexp.weight", il);
        }
        if (Fs > 0) {
            ADD(INIT_LINEAR, (float)d, 2, d, Fs, 1, "blk.%d.ffn_gate_shexp.weight", il);
            ADD(INIT_LINEAR, (float)d, 2, d, Fs, 1, "blk.%d.ffn_up_shexp.weight", il);
            ADD(INIT_LINEAR, (float)Fs, 2, Fs, d, 1, "blk.%d.ffn_down_shexp.weight", il);
        }
    }
    ADD(INIT_NORM, 1, 1, d, 1, 1, "output_norm.weight", 0);
    ADD(INIT_LINEAR, (float)d, 2, d, p->n_vocab, 1, "output.weight", 0);
#undef ADD
    return MOETAX_OK;
}

/* a x b x c, or UINT64_MAX where it overflows */
static uint64_t mul3_sat(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t ab, abc;
    return __builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc) ? UINT64_MAX : abc;
}

static uint64_t add_sat(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

static uint64_t tensor_bytes(const struct gen_tensor *t) {
    return mul3_sat(moetax_row_size(t->type, t->ne[0]), (uint64_t)t->ne[1], (uint64_t)t->ne[2]);
}

/* saturated at UINT64_MAX: the dimensions are bounded one by one, not their products */
void moetax_gen_size(const struct moetax_gen_params *p, uint64_t *n_params, uint64_t *n_bytes) {
    struct tensor_list l = {.p = p};
    *n_params = *n_bytes = 0;
    if (build_tensors(p, &l) == MOETAX_OK)
        for (int i = 0; i < l.n; i++) {
            *n_params = add_sat(*n_params, mul3_sat((uint64_t)l.t[i].ne[0], (uint64_t)l.t[i].ne[1], (uint64_t)l.t[i].ne[2]));
            *n_bytes = add_sat(*n_bytes, tensor_bytes(&l.t[i]));
        }
    free(l.t);
}

/* ---- values ------------------------------------------------------------------ */

struct rng {
    uint64_t s[2];
};

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void rng_seed(struct rng *r, uint64_t seed, const char *name) {
    uint64_t x = seed;
    for (const char *c = name; *c; c++) x = (x ^ (uint8_t)*c) * 1099511628211ull;
    r->s[0] = splitmix(&x);
    r->s[1] = splitmix(&x) | 1;
}

static inline uint64_t rng_next(struct rng *r) { /* xorshift128+ */
    uint64_t s1 = r->s[0];
    const uint64_t s0 = r->s[1];
    r->s[0] = s0;
    s1 ^= s1 << 23;
    r->s[1] = s1 ^ s0 ^ (s1 >> 17) ^ (s0 >> 26);
    return r->s[1] + s0;
}

/* n values with mean 0 and the given standard deviation: uniform on
 * [-sqrt(3) std, sqrt(3) std) (same variance as a normal, bounded). */
static void fill(struct rng *r, const struct gen_tensor *t, float *x, int64_t n) {
    float a = 1.7320508f * t->std, mean = t->init == INIT_NORM ? 1.0f : 0.0f;
    int64_t i = 0;
    for (; i + 1 < n; i += 2) {
        uint64_t u = rng_next(r);
        x[i] = mean + a * ((float)(uint32_t)u * 4.656612873e-10f - 1.0f);
        x[i + 1] = mean + a * ((float)(uint32_t)(u >> 32) * 4.656612873e-10f - 1.0f);
    }
    if (i < n) x[i] = mean + a * ((float)(uint32_t)rng_next(r) * 4.656612873e-10f - 1.0f);
}

/* ---- metadata ---------------------------------------------------------------- */

static moetax_status write_metadata(const struct moetax_gen_params *p, struct moetax_gguf_writer *w) {
    moetax_status st = MOETAX_OK;
    char key[128];
    const char *arch = p->dense_twin ? moetax_gen_twin_arch_gguf(p->arch) : moetax_gen_arch_gguf(p->arch);
#define KEY(s) (snprintf(key, sizeof key, "%s.%s", arch, s), key)
#define TRY(x) do { if ((st = (x))) goto out; } while (0)
    struct moetax_gen_vocab v;
    if ((st = moetax_gen_vocab_build(p->n_vocab, &v))) return st;
    const uint32_t ftype = moetax_type_llama_ftype(p->wtype);
    bool has_moe = !p->dense_twin && p->n_layer_dense_lead < p->n_layer;
    int64_t H = p->n_head;
    TRY(moetax_gguf_writer_set_str(w, "general.architecture", arch));
    TRY(moetax_gguf_writer_set_str(w, "general.name", p->name ? p->name : "moetax-random"));
    TRY(moetax_gguf_writer_set_u32(w, "general.file_type", ftype));
    TRY(moetax_gguf_writer_set_u32(w, "general.quantization_version", 2));
    TRY(moetax_gguf_writer_set_u32(w, KEY("context_length"), (uint32_t)p->n_ctx));
    TRY(moetax_gguf_writer_set_u32(w, KEY("embedding_length"), (uint32_t)p->n_embd));
    TRY(moetax_gguf_writer_set_u32(w, KEY("block_count"), (uint32_t)p->n_layer));
    if (p->dense_twin && gen_gqa(p->arch)) {
        /* the dense sibling llama.cpp loads (qwen3, qwen2, llama without experts; olmoe has none, so
         * its twin stays olmoe with no expert keys, a file moetax runs and llama.cpp refuses): the
         * MoE file's attention keys, feed_forward_length the twin's width */
        const int64_t twin_ff = (int64_t)p->n_expert_used * p->n_ff_exp + p->n_ff_shexp;
        TRY(moetax_gguf_writer_set_u32(w, KEY("feed_forward_length"), (uint32_t)twin_ff));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.head_count"), (uint32_t)H));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.head_count_kv"), (uint32_t)p->n_head_kv));
        if (p->arch != MOETAX_GEN_OLMOE && (int64_t)p->n_embd_head * H != p->n_embd) {
            TRY(moetax_gguf_writer_set_u32(w, KEY("attention.key_length"), (uint32_t)p->n_embd_head));
            TRY(moetax_gguf_writer_set_u32(w, KEY("attention.value_length"), (uint32_t)p->n_embd_head));
        }
        TRY(moetax_gguf_writer_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), p->rms_eps));
        TRY(moetax_gguf_writer_set_f32(w, KEY("rope.freq_base"), p->rope_freq_base));
        if (p->arch == MOETAX_GEN_MIXTRAL) {
            TRY(moetax_gguf_writer_set_u32(w, KEY("vocab_size"), (uint32_t)p->n_vocab));
            TRY(moetax_gguf_writer_set_u32(w, KEY("rope.dimension_count"), (uint32_t)p->n_embd_head));
        }
        goto vocab;
    }
    if (p->arch == MOETAX_GEN_QWEN3MOE) { /* the keys llama.cpp's converter writes for Qwen3-MoE */
        TRY(moetax_gguf_writer_set_u32(w, KEY("feed_forward_length"), (uint32_t)p->n_ff));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.head_count"), (uint32_t)H));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.head_count_kv"), (uint32_t)p->n_head_kv));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.key_length"), (uint32_t)p->n_embd_head));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.value_length"), (uint32_t)p->n_embd_head));
        TRY(moetax_gguf_writer_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), p->rms_eps));
        TRY(moetax_gguf_writer_set_f32(w, KEY("rope.freq_base"), p->rope_freq_base));
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_count"), (uint32_t)p->n_expert));
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_used_count"), (uint32_t)p->n_expert_used));
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_feed_forward_length"), (uint32_t)p->n_ff_exp));
        goto vocab;
    }
    if (p->arch == MOETAX_GEN_QWEN2MOE) { /* the keys llama.cpp's converter writes for Qwen2-MoE */
        TRY(moetax_gguf_writer_set_u32(w, KEY("feed_forward_length"), (uint32_t)p->n_ff_shexp));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.head_count"), (uint32_t)H));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.head_count_kv"), (uint32_t)p->n_head_kv));
        TRY(moetax_gguf_writer_set_f32(w, KEY("rope.freq_base"), p->rope_freq_base));
        TRY(moetax_gguf_writer_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), p->rms_eps));
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_count"), (uint32_t)p->n_expert));
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_used_count"), (uint32_t)p->n_expert_used));
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_feed_forward_length"), (uint32_t)p->n_ff_exp));
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_shared_feed_forward_length"), (uint32_t)p->n_ff_shexp));
        if (p->expert_weights_norm) /* norm_topk_prob true: a key llama.cpp's converter never writes (it ignores it) */
            TRY(moetax_gguf_writer_set_bool(w, KEY("expert_weights_norm"), true));
        goto vocab;
    }
    if (p->arch == MOETAX_GEN_OLMOE || p->arch == MOETAX_GEN_MIXTRAL) {
        /* the keys llama.cpp's converter writes for OLMoE / Mixtral: the experts' width is
         * feed_forward_length; Mixtral adds vocab_size and rope.dimension_count (llama's
         * converter), and key/value_length when the head dim is not n_embd / n_head */
        const bool mix = p->arch == MOETAX_GEN_MIXTRAL;
        TRY(moetax_gguf_writer_set_u32(w, KEY("feed_forward_length"), (uint32_t)p->n_ff_exp));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.head_count"), (uint32_t)H));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.head_count_kv"), (uint32_t)p->n_head_kv));
        if (mix && (int64_t)p->n_embd_head * H != p->n_embd) {
            TRY(moetax_gguf_writer_set_u32(w, KEY("attention.key_length"), (uint32_t)p->n_embd_head));
            TRY(moetax_gguf_writer_set_u32(w, KEY("attention.value_length"), (uint32_t)p->n_embd_head));
        }
        TRY(moetax_gguf_writer_set_f32(w, KEY("rope.freq_base"), p->rope_freq_base));
        TRY(moetax_gguf_writer_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), p->rms_eps));
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_count"), (uint32_t)p->n_expert));
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_used_count"), (uint32_t)p->n_expert_used));
        if (mix) {
            TRY(moetax_gguf_writer_set_u32(w, KEY("vocab_size"), (uint32_t)p->n_vocab));
            TRY(moetax_gguf_writer_set_u32(w, KEY("rope.dimension_count"), (uint32_t)p->n_embd_head));
        }
        goto vocab;
    }
    if (p->dense_twin && p->n_layer_dense_lead > 0 && p->n_ff != (p->n_expert_used + p->n_expert_shared) * p->n_ff_exp) {
        /* a twin keeps the leading dense layers' width: per-layer widths as an array
         * (llama.cpp reads feed_forward_length as a scalar or a per-layer array) */
        uint32_t *ff = malloc(sizeof(uint32_t) * (size_t)p->n_layer);
        if (!ff) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto out; }
        for (int i = 0; i < p->n_layer; i++)
            ff[i] = (uint32_t)(i < p->n_layer_dense_lead ? p->n_ff : (p->n_expert_used + p->n_expert_shared) * p->n_ff_exp);
        st = moetax_gguf_writer_set_arr(w, KEY("feed_forward_length"), MOETAX_GGUF_TYPE_UINT32, ff, (uint64_t)p->n_layer);
        free(ff);
        if (st) goto out;
    } else {
        TRY(moetax_gguf_writer_set_u32(w, KEY("feed_forward_length"),
                                       (uint32_t)(p->dense_twin && p->n_layer_dense_lead == 0
                                                      ? (p->n_expert_used + p->n_expert_shared) * p->n_ff_exp
                                                      : p->n_ff)));
    }
    TRY(moetax_gguf_writer_set_u32(w, KEY("attention.head_count"), (uint32_t)H));
    if (p->kv_b_merged) {
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.head_count_kv"), (uint32_t)H));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.key_length"),
                                       (uint32_t)(p->n_embd_head_qk_nope + p->n_embd_head_qk_rope)));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.value_length"), (uint32_t)p->n_embd_head_v));
    } else {
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.head_count_kv"), 1));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.key_length"),
                                       (uint32_t)(p->kv_lora_rank + p->n_embd_head_qk_rope)));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.value_length"), (uint32_t)p->kv_lora_rank));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.key_length_mla"),
                                       (uint32_t)(p->n_embd_head_qk_nope + p->n_embd_head_qk_rope)));
        TRY(moetax_gguf_writer_set_u32(w, KEY("attention.value_length_mla"), (uint32_t)p->n_embd_head_v));
    }
    TRY(moetax_gguf_writer_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), p->rms_eps));
    /* llama.cpp requires the key (0 = plain attn_q) unless it recognises a Lite layer count */
    TRY(moetax_gguf_writer_set_u32(w, KEY("attention.q_lora_rank"), (uint32_t)p->q_lora_rank));
    TRY(moetax_gguf_writer_set_u32(w, KEY("attention.kv_lora_rank"), (uint32_t)p->kv_lora_rank));
    TRY(moetax_gguf_writer_set_f32(w, KEY("rope.freq_base"), p->rope_freq_base));
    TRY(moetax_gguf_writer_set_u32(w, KEY("rope.dimension_count"), (uint32_t)p->n_embd_head_qk_rope));
    if (p->rope_yarn_factor > 0) {
        TRY(moetax_gguf_writer_set_str(w, KEY("rope.scaling.type"), "yarn"));
        TRY(moetax_gguf_writer_set_f32(w, KEY("rope.scaling.factor"), p->rope_yarn_factor));
        TRY(moetax_gguf_writer_set_u32(w, KEY("rope.scaling.original_context_length"), (uint32_t)p->rope_yarn_orig_ctx));
        TRY(moetax_gguf_writer_set_f32(w, KEY("rope.scaling.yarn_log_multiplier"), p->rope_yarn_log_mul));
    }
    TRY(moetax_gguf_writer_set_u32(w, KEY("leading_dense_block_count"),
                                   (uint32_t)(p->dense_twin ? p->n_layer : p->n_layer_dense_lead)));
    TRY(moetax_gguf_writer_set_u32(w, KEY("vocab_size"), (uint32_t)p->n_vocab));
    if (has_moe) {
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_count"), (uint32_t)p->n_expert));
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_used_count"), (uint32_t)p->n_expert_used));
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_shared_count"), (uint32_t)p->n_expert_shared));
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_feed_forward_length"), (uint32_t)p->n_ff_exp));
        TRY(moetax_gguf_writer_set_f32(w, KEY("expert_weights_scale"), p->expert_weights_scale));
        TRY(moetax_gguf_writer_set_bool(w, KEY("expert_weights_norm"), p->expert_weights_norm));
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_gating_func"), (uint32_t)p->gating_func));
        if (p->n_expert_group > 1) {
            TRY(moetax_gguf_writer_set_u32(w, KEY("expert_group_count"), (uint32_t)p->n_expert_group));
            TRY(moetax_gguf_writer_set_u32(w, KEY("expert_group_used_count"), (uint32_t)p->n_expert_group_used));
        }
    } else {
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_count"), 0));
        TRY(moetax_gguf_writer_set_u32(w, KEY("expert_used_count"), 0));
    }
vocab:
    TRY(moetax_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2"));
    TRY(moetax_gguf_writer_set_str(w, "tokenizer.ggml.pre", "default"));
    TRY(moetax_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)v.tokens, (uint64_t)v.n_tokens));
    TRY(moetax_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", MOETAX_GGUF_TYPE_INT32, v.token_type,
                                   (uint64_t)v.n_tokens));
    TRY(moetax_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", (const char *const *)v.merges, (uint64_t)v.n_merges));
    TRY(moetax_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)v.bos_id));
    TRY(moetax_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)v.eos_id));
    TRY(moetax_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", true));
    TRY(moetax_gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", false));
out:
    moetax_gen_vocab_free(&v);
#undef KEY
#undef TRY
    return st;
}

moetax_status moetax_gen_write(const struct moetax_gen_params *p, const char *path, moetax_gen_progress_fn progress,
                               void *user) {
    moetax_status st = moetax_gen_validate(p);
    if (st) return st;
    uint64_t n_params, n_bytes;
    moetax_gen_size(p, &n_params, &n_bytes);
    if (n_params > MOETAX_GEN_MAX_PARAMS)
        return moetax_error(MOETAX_ERR_ARG, "the shape has %s%.4g parameters: more than the %.4g a generated model "
                            "may have", n_params == UINT64_MAX ? "over " : "", (double)n_params,
                            (double)MOETAX_GEN_MAX_PARAMS);
    struct tensor_list l = {.p = p};
    struct moetax_gguf_writer *w = NULL;
    float *vals = NULL;
    void *buf = NULL;
    if ((st = build_tensors(p, &l))) goto out;
    if ((st = moetax_gguf_writer_init(path, &w))) goto out;
    if ((st = write_metadata(p, w))) goto out;
    for (int i = 0; i < l.n; i++) {
        const struct gen_tensor *t = &l.t[i];
        if ((st = moetax_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne))) goto out;
    }
    const int64_t chunk_target = 1 << 20; /* values per chunk */
    /* a row longer than a chunk is filled and converted alone: the buffers hold the longest row too (they
     * held a chunk only, and a row of 1.1 M values overran them) */
    int64_t cap = chunk_target;
    for (int i = 0; i < l.n; i++) cap = l.t[i].ne[0] > cap ? l.t[i].ne[0] : cap;
    vals = malloc(sizeof(float) * (size_t)cap + 4096 * sizeof(float));
    buf = malloc(sizeof(float) * (size_t)cap + 4096 * sizeof(float)); /* no type's row is wider than f32's */
    if (!vals || !buf) { st = moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", path); goto out; }
    uint64_t total = moetax_gguf_writer_data_total(w);
    for (int i = 0; i < l.n; i++) {
        const struct gen_tensor *t = &l.t[i];
        struct rng r;
        rng_seed(&r, p->seed, t->name);
        int64_t rows = t->ne[1] * t->ne[2];
        int64_t rows_per_chunk = chunk_target / t->ne[0];
        if (rows_per_chunk < 1) rows_per_chunk = 1;
        for (int64_t r0 = 0; r0 < rows; r0 += rows_per_chunk) {
            int64_t nr = rows - r0 < rows_per_chunk ? rows - r0 : rows_per_chunk;
            for (int64_t rr = 0; rr < nr; rr++) {
                float *x = t->ne[0] > chunk_target ? vals : vals + rr * t->ne[0];
                fill(&r, t, x, t->ne[0]);
                if (t->ne[0] > chunk_target) { /* a single huge row: convert and write it alone */
                    if (!moetax_from_float(t->type, x, buf, t->ne[0])) {
                        st = moetax_error(MOETAX_ERR_INTERNAL, "conversion to %s failed", moetax_type_name(t->type));
                        goto out;
                    }
                    if ((st = moetax_gguf_writer_write(w, buf, moetax_row_size(t->type, t->ne[0])))) goto out;
                }
            }
            if (t->ne[0] <= chunk_target) {
                for (int64_t rr = 0; rr < nr; rr++)
                    moetax_from_float(t->type, vals + rr * t->ne[0],
                                      (char *)buf + (size_t)rr * moetax_row_size(t->type, t->ne[0]), t->ne[0]);
                if ((st = moetax_gguf_writer_write(w, buf, (size_t)nr * moetax_row_size(t->type, t->ne[0])))) goto out;
            }
            if (progress) progress(user, moetax_gguf_writer_data_written(w), total);
        }
    }
    st = moetax_gguf_writer_finish(w);
out:
    moetax_gguf_writer_free(w);
    free(vals);
    free(buf);
    free(l.t);
    return st;
}
