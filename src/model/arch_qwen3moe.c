/*
 * arch_qwen3moe.c - the qwen3moe architecture (Qwen3-30B-A3B, Qwen3-235B-A22B), as
 * llama.cpp's qwen3moe graph computes it:
 *   grouped-query attention (src/attn/gqa.c): q = W_q x, k = W_k x, v = W_v x per head;
 *   RMSNorm of each head's q and k over head_dim (attn_q_norm / attn_k_norm {head_dim}),
 *   then RoPE in NEOX mode (halves rotated) over all head_dim values; scale 1/sqrt(head_dim);
 *   every layer is an MoE layer: softmax over the router logits, top-k, the k weights
 *   renormalised to sum 1, no scale, no shared expert (unlike deepseek2, whose routing comes
 *   from its keys, and olmoe, which does not renormalise).
 * Differs from olmoe (arch_olmoe.c) in the q/k norm (per head here, full width there), the
 * renormalisation and the expert width (expert_feed_forward_length here, feed_forward_length
 * there); from llama/Mixtral (arch_llama.c) in the q/k norm (none there), RoPE (NORM there)
 * and the expert width.
 * llama.cpp requires key_length == value_length == rope.dimension_count (n_rot); so does
 * this binding. llama.cpp ignores qwen3moe.expert_weights_scale; so does moetax.
 * qwen3 (dense Qwen3, llama.cpp's qwen3 graph; moetax gen writes qwen3moe's dense twins so):
 * the same attention, every layer a dense SwiGLU FFN feed_forward_length wide.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/arch.h"
#include "moetax/kernels.h"

static moetax_status qwen3_hparams(struct moetax_model *m, bool dense) {
    const struct moetax_gguf *g = m->gguf;
    struct moetax_hparams *hp = &m->hp;
    struct arch_keys k = {.g = g, .arch = hp->arch, .dense = dense};
    moetax_status st = arch_gqa_hparams(m, &k);
    if (st) return st;
    hp->rope_mode = MOETAX_ROPE_MODE_NEOX;
    hp->qk_norm = MOETAX_QK_NORM_HEAD;
    if (dense) {
        return arch_gqa_finish(m, &k);
    }
    hp->n_ff_exp = arch_key_i(&k, "expert_feed_forward_length", 0, false);
    if (hp->n_ff_exp == 0 && hp->n_expert_used > 0) hp->n_ff_exp = hp->n_ff / hp->n_expert_used; /* llama.cpp's fallback */
    hp->gating_func = 1; /* softmax */
    hp->expert_weights_norm = true;
    hp->expert_weights_scale = 1.0f;
    if (k.st) return k.st;
    st = arch_check_moe(m, 0);
    if (st) return st;
    return arch_gqa_finish(m, &k);
}

static moetax_status qwen3moe_hparams(struct moetax_model *m) { return qwen3_hparams(m, false); }
static moetax_status qwen3_dense_hparams(struct moetax_model *m) { return qwen3_hparams(m, true); }

static moetax_status qwen3moe_layer(struct moetax_model *m, int il) {
    const struct moetax_hparams *hp = &m->hp;
    struct moetax_layer *l = &m->layers[il];
    const int64_t d = hp->n_embd, H = hp->n_head, Hkv = hp->n_head_kv, hk = hp->n_embd_head_k, hv = hp->n_embd_head_v;
    char n[128];
    moetax_status st;
#define NAME(s) (snprintf(n, sizeof n, "blk.%d." s, il), n)
#define TRY(x) do { if ((st = (x))) return st; } while (0)
    TRY(arch_bind_vec(m, &l->attn_norm, NAME("attn_norm.weight"), true, d));
    TRY(arch_bind(m, &l->wq, NAME("attn_q.weight"), true, 2, d, H * hk, 1));
    TRY(arch_bind(m, &l->wk, NAME("attn_k.weight"), true, 2, d, Hkv * hk, 1));
    TRY(arch_bind(m, &l->wv, NAME("attn_v.weight"), true, 2, d, Hkv * hv, 1));
    TRY(arch_bind(m, &l->wo, NAME("attn_output.weight"), true, 2, H * hv, d, 1));
    TRY(arch_bind_vec(m, &l->attn_q_norm, NAME("attn_q_norm.weight"), true, hk));
    TRY(arch_bind_vec(m, &l->attn_k_norm, NAME("attn_k_norm.weight"), true, hk));
#undef NAME
#undef TRY
    return arch_bind_ffn(m, il);
}

const struct moetax_arch moetax_arch_qwen3moe = {
    .name = "qwen3moe",
    .load_hparams = qwen3moe_hparams,
    .bind_layer = qwen3moe_layer,
};

const struct moetax_arch moetax_arch_qwen3 = {
    .name = "qwen3",
    .load_hparams = qwen3_dense_hparams,
    .bind_layer = qwen3moe_layer, /* arch_bind_ffn binds the dense FFN of a layer below n_layer_dense_lead */
};
