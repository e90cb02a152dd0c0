/*
 * arch_llama.c - the llama architecture with experts (Mixtral 8x7B / 8x22B), as llama.cpp's
 * llama graph (src/models/llama.cpp) computes it when a layer has ffn_gate_inp:
 *   grouped-query attention (src/attn/gqa.c): q = W_q x, k = W_k x, v = W_v x, no q/k norm,
 *   RoPE in NORM mode (adjacent pairs (2i, 2i+1); the converter permutes W_q/W_k rows for it)
 *   over all head_dim values; scale 1/sqrt(head_dim) (llama.cpp's llama loader does not read
 *   attention.scale, so f_attention_scale stays 0 and the default applies);
 *   every layer is an MoE layer: softmax over the router logits, top-k, the k probabilities
 *   renormalised to sum 1 (norm_w = true), no scale, no shared expert. Softmax, top-k and
 *   renormalisation equal a softmax over the selected experts' logits: Mixtral's
 *   softmax(topk(logits)) in the reference implementation.
 * Where it differs from the others:
 *   - qwen3moe (arch_qwen3moe.c): per-head q/k norm, NEOX RoPE, experts
 *     expert_feed_forward_length wide; routing the same (softmax, top-k, renormalised).
 *   - olmoe (arch_olmoe.c): full-width q/k norm, NEOX RoPE, no renormalisation; experts
 *     feed_forward_length wide, as here.
 *   - deepseek2 (arch_deepseek2.c): MLA, routing from its keys, shared experts.
 * Expert width: llama.cpp binds ffn_{gate,up,down}_exps as {n_embd, n_ff, n_expert} with
 * n_ff = llama.feed_forward_length. A llama file without experts (llama.expert_count absent or
 * 0) is a dense llama: every layer a SwiGLU FFN (ffn_gate/up/down) feed_forward_length wide, the
 * same attention (moetax gen writes Mixtral's dense twins so). Refused with a message (llama.cpp
 * computes them, moetax does not yet): experts split one tensor per expert
 * (blk.N.ffn_gate.E.weight, older conversions; current llama.cpp no longer reads them
 * either), attn_output.bias and rope_freqs.weight (Llama-3 rope factors), rope scaling
 * of type longrope.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/arch.h"
#include "moetax/kernels.h"

static moetax_status llama_hparams(struct moetax_model *m) {
    const struct moetax_gguf *g = m->gguf;
    struct moetax_hparams *hp = &m->hp;
    struct arch_keys k = {.g = g, .arch = hp->arch};
    int32_t n_expert = arch_key_i(&k, "expert_count", 0, false);
    if (k.st) return k.st;
    k.dense = n_expert == 0;
    moetax_status st = arch_gqa_hparams(m, &k);
    if (st) return st;
    hp->rope_mode = MOETAX_ROPE_MODE_NORM;
    hp->qk_norm = MOETAX_QK_NORM_NONE;
    if (hp->n_ff <= 0)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: llama.feed_forward_length (the experts' width) must be positive",
                            g->path);
    hp->n_ff_exp = k.dense ? 0 : hp->n_ff;
    hp->gating_func = 1; /* softmax */
    hp->expert_weights_norm = true;
    hp->expert_weights_scale = 1.0f;
    char stype[32] = "";
    if (moetax_gguf_find_kv(g, "llama.rope.scaling.type") &&
        (st = moetax_gguf_get_str(g, "llama.rope.scaling.type", stype, sizeof stype)))
        return st;
    if (!strcmp(stype, "longrope"))
        return moetax_error(MOETAX_ERR_UNSUPPORTED, "%s: llama.rope.scaling.type longrope is not supported", g->path);
    st = arch_check_moe(m, k.dense ? hp->n_layer : 0);
    if (st) return st;
    return arch_gqa_finish(m, &k);
}

/* A tensor llama.cpp's llama graph would use and moetax does not: refused naming it. */
static moetax_status refuse_if_present(const struct moetax_model *m, const char *name, const char *what) {
    if (!moetax_gguf_find_tensor(m->gguf, name)) return MOETAX_OK;
    return moetax_error(MOETAX_ERR_UNSUPPORTED, "%s: tensor '%s' (%s) is not supported yet", m->gguf->path, name, what);
}

static moetax_status llama_layer(struct moetax_model *m, int il) {
    const struct moetax_hparams *hp = &m->hp;
    struct moetax_layer *l = &m->layers[il];
    const int64_t d = hp->n_embd, H = hp->n_head, Hkv = hp->n_head_kv, hk = hp->n_embd_head_k, hv = hp->n_embd_head_v;
    char n[128];
    moetax_status st;
#define NAME(s) (snprintf(n, sizeof n, "blk.%d." s, il), n)
#define TRY(x) do { if ((st = (x))) return st; } while (0)
    if (il == 0) TRY(refuse_if_present(m, "rope_freqs.weight", "Llama-3 rope frequency factors"));
    TRY(refuse_if_present(m, NAME("attn_output.bias"), "an attention output bias"));
    if (hp->n_expert > 0 && !moetax_gguf_find_tensor(m->gguf, NAME("ffn_gate_inp.weight"))) {
        snprintf(n, sizeof n, "blk.%d.ffn_gate.weight", il);
        return moetax_error(MOETAX_ERR_UNSUPPORTED,
                            "%s: layer %d has no router (blk.%d.ffn_gate_inp.weight%s): a dense llama layer; moetax "
                            "runs llama files whose every layer has experts (Mixtral) only",
                            m->gguf->path, il, il, moetax_gguf_find_tensor(m->gguf, n) ? ", but ffn_gate.weight" : "");
    }
    snprintf(n, sizeof n, "blk.%d.ffn_gate_exps.weight", il);
    if (hp->n_expert > 0 && !moetax_gguf_find_tensor(m->gguf, n)) {
        snprintf(n, sizeof n, "blk.%d.ffn_gate.0.weight", il);
        if (moetax_gguf_find_tensor(m->gguf, n))
            return moetax_error(MOETAX_ERR_UNSUPPORTED,
                                "%s: tensor '%s': this file stores each expert as its own tensor (an older "
                                "conversion); moetax (like current llama.cpp) reads the merged "
                                "blk.N.ffn_{gate,up,down}_exps.weight tensors: convert the model again with a current "
                                "llama.cpp convert_hf_to_gguf.py (or download a newer GGUF)",
                                m->gguf->path, n);
    }
    TRY(arch_bind_vec(m, &l->attn_norm, NAME("attn_norm.weight"), true, d));
    TRY(arch_bind(m, &l->wq, NAME("attn_q.weight"), true, 2, d, H * hk, 1));
    TRY(arch_bind(m, &l->wk, NAME("attn_k.weight"), true, 2, d, Hkv * hk, 1));
    TRY(arch_bind(m, &l->wv, NAME("attn_v.weight"), true, 2, d, Hkv * hv, 1));
    TRY(arch_bind(m, &l->wo, NAME("attn_output.weight"), true, 2, H * hv, d, 1));
#undef NAME
#undef TRY
    return arch_bind_ffn(m, il);
}

const struct moetax_arch moetax_arch_llama = {
    .name = "llama",
    .load_hparams = llama_hparams,
    .bind_layer = llama_layer,
};
