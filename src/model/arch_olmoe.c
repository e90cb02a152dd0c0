/*
 * arch_olmoe.c - the olmoe architecture (OLMoE-1B-7B), as llama.cpp's olmoe graph
 * (src/models/olmoe.cpp) computes it:
 *   grouped-query attention (src/attn/gqa.c): q = W_q x, k = W_k x, v = W_v x;
 *   RMSNorm of q over its whole row (attn_q_norm {H*head_dim}) and of k over its whole row
 *   (attn_k_norm {Hkv*head_dim}) BEFORE the heads are split, then RoPE in NEOX mode over all
 *   head_dim values of each head; scale 1/sqrt(head_dim);
 *   every layer is an MoE layer: softmax over the router logits, top-k, the k probabilities
 *   used as they are (NOT renormalised), no scale, no shared expert.
 * Where it differs from the others:
 *   - qwen3moe (arch_qwen3moe.c) norms q and k per head ({head_dim} weights) and renormalises
 *     the top-k weights; its experts are expert_feed_forward_length wide.
 *   - llama/Mixtral (arch_llama.c) has no q/k norm, RoPE in NORM mode (adjacent pairs) and
 *     renormalises; like olmoe its experts are feed_forward_length wide.
 *   - deepseek2 (arch_deepseek2.c) has MLA attention, routing from its keys, shared experts.
 * Expert width: llama.cpp's olmoe binds the experts as {n_embd, n_ff, n_expert} with n_ff =
 * olmoe.feed_forward_length (the converter writes intermediate_size there);
 * expert_feed_forward_length is not read. olmoe.expert_weights_scale is ignored: llama.cpp
 * passes hparams.expert_weights_scale to build_moe_ffn (which scales when it is not 0 or 1),
 * but its olmoe loader never reads the key, so it stays 0.
 * Shapes: llama.cpp binds attn_q, attn_output, attn_q_norm and attn_k_norm as {n_embd}-wide,
 * so the files it loads have n_head * head_dim = n_embd and head_count_kv = head_count (as
 * OLMoE-1B-7B has); moetax binds the general shapes ({H*hd}, {Hkv*hd}), which are the same
 * for those files, and also runs GQA olmoe files llama.cpp would refuse.
 * An olmoe file without olmoe.expert_count (or with 0) is run as dense (every layer a SwiGLU FFN
 * feed_forward_length wide): the dense twins moetax gen writes for olmoe (llama.cpp has no
 * dense sibling of olmoe's graph and refuses them).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/arch.h"
#include "moetax/kernels.h"

static moetax_status olmoe_hparams(struct moetax_model *m) {
    const struct moetax_gguf *g = m->gguf;
    struct moetax_hparams *hp = &m->hp;
    struct arch_keys k = {.g = g, .arch = hp->arch};
    k.dense = arch_key_i(&k, "expert_count", 0, false) == 0;
    if (k.st) return k.st;
    moetax_status st = arch_gqa_hparams(m, &k);
    if (st) return st;
    hp->rope_mode = MOETAX_ROPE_MODE_NEOX;
    hp->qk_norm = MOETAX_QK_NORM_FULL;
    if (k.dense) {
        return arch_gqa_finish(m, &k);
    }
    if (hp->n_ff <= 0)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: olmoe.feed_forward_length (the experts' width) must be positive",
                            g->path);
    hp->n_ff_exp = hp->n_ff;
    hp->gating_func = 1; /* softmax */
    hp->expert_weights_norm = false;
    hp->expert_weights_scale = 1.0f;
    st = arch_check_moe(m, 0);
    if (st) return st;
    return arch_gqa_finish(m, &k);
}

static moetax_status olmoe_layer(struct moetax_model *m, int il) {
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
    TRY(arch_bind_vec(m, &l->attn_q_norm, NAME("attn_q_norm.weight"), true, H * hk));
    TRY(arch_bind_vec(m, &l->attn_k_norm, NAME("attn_k_norm.weight"), true, Hkv * hk));
#undef NAME
#undef TRY
    return arch_bind_ffn(m, il);
}

const struct moetax_arch moetax_arch_olmoe = {
    .name = "olmoe",
    .load_hparams = olmoe_hparams,
    .bind_layer = olmoe_layer,
};
