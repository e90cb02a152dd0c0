/*
 * arch_deepseek2.c - the deepseek2 architecture (DeepSeek-V2, V2-Lite, V2.5, V3, R1): its
 * hyper-parameters from the metadata (as llama.cpp derives them, including the YaRN attention
 * scale) and its MLA attention tensors, each checked against the shape the metadata implies.
 * Attention: src/attn/mla.c. The FFN / MoE tensors are bound by the shared arch_bind_ffn.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/arch.h"
#include "moetax/kernels.h"

static moetax_status deepseek2_hparams(struct moetax_model *m) {
    const struct moetax_gguf *g = m->gguf;
    struct moetax_hparams *hp = &m->hp;
    moetax_status st = MOETAX_OK;
    hp->attn = MOETAX_ATTN_MLA;
    hp->rope_mode = MOETAX_ROPE_MODE_NORM;
    struct arch_keys k = {.g = g, .arch = hp->arch};
    hp->n_ctx_train = arch_key_i(&k, "context_length", 4096, false);
    hp->n_embd = arch_key_i(&k, "embedding_length", 0, true);
    hp->n_layer = arch_key_i(&k, "block_count", 0, true);
    hp->n_head = arch_key_i(&k, "attention.head_count", 0, true);
    hp->n_layer_dense_lead = arch_key_i(&k, "leading_dense_block_count", 0, false);
    char ffkey[160];
    snprintf(ffkey, sizeof ffkey, "%s.feed_forward_length", hp->arch);
    const struct moetax_gguf_kv *ffkv = moetax_gguf_find_kv(g, ffkey);
    if (ffkv && ffkv->type == MOETAX_GGUF_TYPE_ARRAY) {
        /* per-layer widths (llama.cpp accepts a scalar or an array) */
        int64_t v = 0;
        if (ffkv->arr_n != (uint64_t)hp->n_layer || !moetax_gguf_arr_i64(ffkv, 0, &v))
            return moetax_error(MOETAX_ERR_FORMAT, "%s: %s must be a scalar or an integer array of block_count (%d) values",
                                g->path, ffkey, hp->n_layer);
        hp->n_ff = (int32_t)v;
    } else {
        hp->n_ff = arch_key_i(&k, "feed_forward_length", 0, hp->n_layer_dense_lead > 0);
    }
    hp->q_lora_rank = arch_key_i(&k, "attention.q_lora_rank", 0, false);
    hp->kv_lora_rank = arch_key_i(&k, "attention.kv_lora_rank", 0, true);
    hp->n_embd_head_qk_rope = arch_key_i(&k, "rope.dimension_count", 0, true);
    int32_t klen = arch_key_i(&k, "attention.key_length_mla", -1, false);
    int32_t vlen = arch_key_i(&k, "attention.value_length_mla", -1, false);
    if (klen < 0) klen = arch_key_i(&k, "attention.key_length", 0, true);
    if (vlen < 0) vlen = arch_key_i(&k, "attention.value_length", 0, true);
    hp->n_embd_head_qk_nope = klen - hp->n_embd_head_qk_rope;
    hp->n_embd_head_v = vlen;
    hp->n_expert = arch_key_i(&k, "expert_count", 0, false);
    hp->n_expert_used = arch_key_i(&k, "expert_used_count", 0, hp->n_expert > 0);
    hp->n_expert_shared = arch_key_i(&k, "expert_shared_count", 0, false);
    hp->n_ff_exp = arch_key_i(&k, "expert_feed_forward_length", 0, hp->n_expert > 0);
    hp->n_expert_group = arch_key_i(&k, "expert_group_count", 0, false);
    hp->n_expert_group_used = arch_key_i(&k, "expert_group_used_count", 0, false);
    hp->gating_func = arch_key_i(&k, "expert_gating_func", 1, false);
    hp->expert_weights_scale = arch_key_f(&k, "expert_weights_scale", 1.0f); /* absent: none (x 1) */
    hp->rms_eps = arch_key_f(&k, "attention.layer_norm_rms_epsilon", NAN); /* NAN: absent (a NaN value is an error) */
    char key[160];
    snprintf(key, sizeof key, "%s.expert_weights_norm", hp->arch);
    bool b = false;
    if (!k.st && moetax_gguf_find_kv(g, key) && (st = moetax_gguf_get_bool(g, key, &b))) k.st = st;
    hp->expert_weights_norm = b;
    if (k.st) return k.st;
#define NEED(cond, ...) do { if (!(cond)) return moetax_error(MOETAX_ERR_FORMAT, __VA_ARGS__); } while (0)
    NEED(!isnan(hp->rms_eps), "%s: %s.attention.layer_norm_rms_epsilon is missing", g->path, hp->arch);
    NEED(hp->n_embd > 0 && hp->n_layer > 0 && hp->n_head > 0 && hp->kv_lora_rank > 0,
         "%s: embedding_length, block_count, head_count and kv_lora_rank must be positive", g->path);
    NEED(hp->n_embd_head_qk_rope > 0 && hp->n_embd_head_qk_rope % 2 == 0 && hp->n_embd_head_qk_rope <= 1024,
         "%s: rope.dimension_count %d must be even and in 2..1024", g->path, hp->n_embd_head_qk_rope);
    NEED(hp->n_embd_head_qk_nope > 0 && hp->n_embd_head_v > 0,
         "%s: key length %d must exceed the rope dims %d, value length must be positive", g->path, klen,
         hp->n_embd_head_qk_rope);
    NEED(hp->n_layer_dense_lead <= hp->n_layer, "%s: leading_dense_block_count %d > block_count %d", g->path,
         hp->n_layer_dense_lead, hp->n_layer);
    if ((st = arch_check_moe(m, hp->n_layer_dense_lead))) return st;
#undef NEED

    /* rope as every architecture derives it; the attention scale with deepseek2's YaRN mscale */
    const double mscale = arch_rope_hparams(m, &k);
    hp->n_rot = hp->n_embd_head_qk_rope;
    hp->kq_scale = (float)(mscale * mscale / sqrt((double)(hp->n_embd_head_qk_nope + hp->n_embd_head_qk_rope)));
    if (k.st) return k.st;
    return moetax_hparams_check(hp, g->path);
}

/* Split the older attn_kv_b {kv_lora, H*(nope+v)} into F32 k_b {nope, kv_lora, H} and v_b {kv_lora, v, H}. */
static moetax_status split_kv_b(struct moetax_model *m, struct moetax_layer *l, const struct moetax_weight *kvb) {
    const struct moetax_hparams *hp = &m->hp;
    const int64_t H = hp->n_head, nope = hp->n_embd_head_qk_nope, vh = hp->n_embd_head_v, kvl = hp->kv_lora_rank;
    float *row = arch_own(m, sizeof(float) * (size_t)kvl);
    float *kb = arch_own(m, sizeof(float) * (size_t)(H * kvl * nope));
    float *vb = arch_own(m, sizeof(float) * (size_t)(H * vh * kvl));
    if (!row || !kb || !vb) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    for (int64_t h = 0; h < H; h++) {
        for (int64_t j = 0; j < nope + vh; j++) {
            moetax_to_float(kvb->type, (const char *)kvb->data + (size_t)(h * (nope + vh) + j) * kvb->row_bytes, row, kvl);
            if (j < nope)
                for (int64_t c = 0; c < kvl; c++) kb[(h * kvl + c) * nope + j] = row[c];
            else
                memcpy(vb + (h * vh + (j - nope)) * kvl, row, sizeof(float) * (size_t)kvl);
        }
    }
    l->wk_b = (struct moetax_weight){.data = kb, .type = MOETAX_TYPE_F32, .ne = {nope, kvl, H},
                                     .row_bytes = sizeof(float) * (size_t)nope, .mat_bytes = sizeof(float) * (size_t)(nope * kvl)};
    l->wv_b = (struct moetax_weight){.data = vb, .type = MOETAX_TYPE_F32, .ne = {kvl, vh, H},
                                     .row_bytes = sizeof(float) * (size_t)kvl, .mat_bytes = sizeof(float) * (size_t)(kvl * vh)};
    return MOETAX_OK;
}

static moetax_status deepseek2_layer(struct moetax_model *m, int il) {
    const struct moetax_hparams *hp = &m->hp;
    struct moetax_layer *l = &m->layers[il];
    const int64_t d = hp->n_embd, H = hp->n_head, nope = hp->n_embd_head_qk_nope, rope = hp->n_embd_head_qk_rope;
    const int64_t vh = hp->n_embd_head_v, kvl = hp->kv_lora_rank, ql = hp->q_lora_rank;
    char n[128];
    moetax_status st;
#define NAME(s) (snprintf(n, sizeof n, "blk.%d." s, il), n)
#define TRY(x) do { if ((st = (x))) return st; } while (0)
    TRY(arch_bind_vec(m, &l->attn_norm, NAME("attn_norm.weight"), true, d));
    if (ql > 0) {
        TRY(arch_bind(m, &l->wq_a, NAME("attn_q_a.weight"), true, 2, d, ql, 1));
        TRY(arch_bind_vec(m, &l->q_a_norm, NAME("attn_q_a_norm.weight"), true, ql));
        TRY(arch_bind(m, &l->wq_b, NAME("attn_q_b.weight"), true, 2, ql, H * (nope + rope), 1));
    } else {
        TRY(arch_bind(m, &l->wq, NAME("attn_q.weight"), true, 2, d, H * (nope + rope), 1));
    }
    TRY(arch_bind(m, &l->wkv_a, NAME("attn_kv_a_mqa.weight"), true, 2, d, kvl + rope, 1));
    TRY(arch_bind_vec(m, &l->kv_a_norm, NAME("attn_kv_a_norm.weight"), true, kvl));
    TRY(arch_bind(m, &l->wk_b, NAME("attn_k_b.weight"), false, 3, nope, kvl, H));
    if (l->wk_b.data) {
        TRY(arch_bind(m, &l->wv_b, NAME("attn_v_b.weight"), true, 3, kvl, vh, H));
    } else {
        struct moetax_weight kvb;
        snprintf(n, sizeof n, "blk.%d.attn_k_b.weight' or 'blk.%d.attn_kv_b.weight", il, il);
        char both[160];
        snprintf(both, sizeof both, "%s", n);
        TRY(arch_bind(m, &kvb, NAME("attn_kv_b.weight"), false, 2, kvl, H * (nope + vh), 1));
        if (!kvb.data) return moetax_error(MOETAX_ERR_NOT_FOUND, "%s: tensor '%s' is missing", m->gguf->path, both);
        TRY(split_kv_b(m, l, &kvb));
    }
    TRY(arch_bind(m, &l->wo, NAME("attn_output.weight"), true, 2, H * vh, d, 1));
#undef NAME
#undef TRY
    return arch_bind_ffn(m, il);
}

const struct moetax_arch moetax_arch_deepseek2 = {
    .name = "deepseek2",
    .load_hparams = deepseek2_hparams,
    .bind_layer = deepseek2_layer,
};
