/*
 * arch_qwen2moe.c - the qwen2moe architecture (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B), as llama.cpp's
 * qwen2moe graph (src/models/qwen2moe.cpp) computes it:
 *   grouped-query attention (src/attn/gqa.c): q = W_q x + b_q, k = W_k x + b_k, v = W_v x + b_v
 *   (the biases attn_{q,k,v}.bias are optional in llama.cpp's loader, present in Qwen's files),
 *   no q/k norm, RoPE in NEOX mode over all head_dim values; scale 1/sqrt(head_dim);
 *   every layer is an MoE layer: softmax over the router logits, top-k, the k probabilities used
 *   as they are (not renormalised: Qwen's norm_topk_prob is false in both published models and
 *   llama.cpp's converter writes no expert_weights_norm for qwen2moe), no scale (llama.cpp's
 *   qwen2moe loader never reads
 *   expert_weights_scale, so it stays 0); plus one shared expert, a SwiGLU FFN of width
 *   expert_shared_feed_forward_length (default feed_forward_length) whose output is scaled per
 *   token by sigmoid(ffn_gate_inp_shexp . x), x the ffn-normed input (the gate: src/moe/moe.c).
 * Where it differs from the others:
 *   - qwen3moe (arch_qwen3moe.c): per-head q/k norm, no biases, renormalised top-k, no shared
 *     expert; experts expert_feed_forward_length wide as here (same fallback n_ff / k).
 *   - olmoe (arch_olmoe.c): full-width q/k norm; routing as here (not renormalised), no shared
 *     expert.
 *   - llama/Mixtral (arch_llama.c): NORM rope, renormalised, no biases, no shared expert.
 *   - deepseek2 (arch_deepseek2.c): MLA; its shared experts are added ungated and are
 *     n_expert_shared * expert_feed_forward_length wide.
 * Where moetax differs from llama.cpp: a file with qwen2moe.expert_weights_norm = true (the HF
 * config's norm_topk_prob, written by a converter other than llama.cpp's) is renormalised as
 * the HF model does (w / max(sum w, 6.103515625e-5)); llama.cpp passes norm_w = false whatever
 * the file holds. Files from llama.cpp's converter have no such key: the same result.
 * Shapes: llama.cpp binds attn_q and attn_output as {n_embd, n_embd} (so its files have
 * head_count * head_dim = n_embd); moetax binds the general GQA shapes ({d, H*hd}, {H*hd, d}),
 * the same for those files. ffn_gate_inp_shexp is {n_embd} ({n_embd, 1} as converted from the
 * HF Linear(d, 1) binds the same). Refused with a message: a fused attn_qkv tensor (llama.cpp
 * accepts it; its converter does not write one for qwen2moe).
 * qwen2 (dense Qwen2, llama.cpp's qwen2 graph; moetax gen writes qwen2moe's dense twins so): the
 * same attention, every layer a dense SwiGLU FFN feed_forward_length wide, no gate.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/arch.h"
#include "moetax/kernels.h"

static moetax_status qwen2_hparams(struct moetax_model *m, bool dense) {
    const struct moetax_gguf *g = m->gguf;
    struct moetax_hparams *hp = &m->hp;
    struct arch_keys k = {.g = g, .arch = hp->arch, .dense = dense};
    moetax_status st = arch_gqa_hparams(m, &k);
    if (st) return st;
    hp->rope_mode = MOETAX_ROPE_MODE_NEOX;
    hp->qk_norm = MOETAX_QK_NORM_NONE;
    if (dense) {
        return arch_gqa_finish(m, &k);
    }
    hp->n_ff_exp = arch_key_i(&k, "expert_feed_forward_length", 0, false);
    if (hp->n_ff_exp == 0 && hp->n_expert_used > 0) hp->n_ff_exp = hp->n_ff / hp->n_expert_used; /* llama.cpp's fallback */
    hp->n_ff_shexp = arch_key_i(&k, "expert_shared_feed_forward_length", 0, false);
    if (hp->n_ff_shexp == 0) hp->n_ff_shexp = hp->n_ff; /* llama.cpp's fallback */
    if (k.st) return k.st;
    if (hp->n_ff_shexp <= 0)
        return moetax_error(MOETAX_ERR_FORMAT,
                            "%s: qwen2moe.expert_shared_feed_forward_length (or feed_forward_length, its default: the "
                            "shared expert's width) must be positive",
                            g->path);
    hp->n_expert_shared = 1;
    hp->gating_func = 1; /* softmax */
    hp->expert_weights_norm = arch_key_bool(&k, "expert_weights_norm", false); /* norm_topk_prob; see above */
    if (k.st) return k.st;
    hp->expert_weights_scale = 1.0f;
    st = arch_check_moe(m, 0);
    if (st) return st;
    return arch_gqa_finish(m, &k);
}

static moetax_status qwen2moe_hparams(struct moetax_model *m) { return qwen2_hparams(m, false); }
static moetax_status qwen2_dense_hparams(struct moetax_model *m) { return qwen2_hparams(m, true); }

static moetax_status qwen2moe_layer(struct moetax_model *m, int il) {
    const struct moetax_hparams *hp = &m->hp;
    struct moetax_layer *l = &m->layers[il];
    const int64_t d = hp->n_embd, H = hp->n_head, Hkv = hp->n_head_kv, hk = hp->n_embd_head_k, hv = hp->n_embd_head_v;
    char n[128];
    moetax_status st;
#define NAME(s) (snprintf(n, sizeof n, "blk.%d." s, il), n)
#define TRY(x) do { if ((st = (x))) return st; } while (0)
    if (moetax_gguf_find_tensor(m->gguf, NAME("attn_qkv.weight")))
        return moetax_error(MOETAX_ERR_UNSUPPORTED,
                            "%s: tensor '%s' (q, k and v fused in one matrix) is not supported yet: moetax reads "
                            "separate attn_q/attn_k/attn_v tensors, as llama.cpp's converter writes them",
                            m->gguf->path, n);
    TRY(arch_bind_vec(m, &l->attn_norm, NAME("attn_norm.weight"), true, d));
    TRY(arch_bind(m, &l->wq, NAME("attn_q.weight"), true, 2, d, H * hk, 1));
    TRY(arch_bind(m, &l->wk, NAME("attn_k.weight"), true, 2, d, Hkv * hk, 1));
    TRY(arch_bind(m, &l->wv, NAME("attn_v.weight"), true, 2, d, Hkv * hv, 1));
    TRY(arch_bind_vec(m, &l->bq, NAME("attn_q.bias"), false, H * hk));
    TRY(arch_bind_vec(m, &l->bk, NAME("attn_k.bias"), false, Hkv * hk));
    TRY(arch_bind_vec(m, &l->bv, NAME("attn_v.bias"), false, Hkv * hv));
    TRY(arch_bind(m, &l->wo, NAME("attn_output.weight"), true, 2, H * hv, d, 1));
    TRY(arch_bind_ffn(m, il));
    if (l->is_moe) TRY(arch_bind_vec(m, &l->gate_inp_shexp, NAME("ffn_gate_inp_shexp.weight"), true, d));
#undef NAME
#undef TRY
    return MOETAX_OK;
}

const struct moetax_arch moetax_arch_qwen2moe = {
    .name = "qwen2moe",
    .load_hparams = qwen2moe_hparams,
    .bind_layer = qwen2moe_layer,
};

const struct moetax_arch moetax_arch_qwen2 = {
    .name = "qwen2",
    .load_hparams = qwen2_dense_hparams,
    .bind_layer = qwen2moe_layer,
};
