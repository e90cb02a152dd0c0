/* arch.h - the architecture layer: one file per architecture (src/model/arch_*.c) binds a GGUF
 * file's hyper-parameters and per-layer tensors into the shared structs of moetax/model.h;
 * everything else (the loader, repacking, the expert store, the step, the MoE block, the
 * ledger) is shared. An architecture is chosen from general.architecture by the table in
 * model.c: adding one is a file and a row there. Internal.
 *
 * DESIGN
 *   load_hparams reads the "<arch>." keys into m->hp (llama.cpp's defaults and derivations
 *   for that architecture, its attention kind, RoPE mode and routing rules) and checks them;
 *   the loader then binds token_embd / output_norm / output and calls bind_layer for every
 *   layer. The helpers below are the loader's: a tensor bound with its shape checked against
 *   the one the metadata implies (the message names both), vectors converted to owned F32.
 */
#ifndef MOETAX_ARCH_H
#define MOETAX_ARCH_H

#include "moetax/model.h"

struct moetax_arch {
    const char *name;                                       /* general.architecture */
    moetax_status (*load_hparams)(struct moetax_model *m);  /* m->hp.arch is set already */
    moetax_status (*bind_layer)(struct moetax_model *m, int il);
};

extern const struct moetax_arch moetax_arch_deepseek2;
extern const struct moetax_arch moetax_arch_qwen3moe;
extern const struct moetax_arch moetax_arch_qwen2moe;
extern const struct moetax_arch moetax_arch_qwen3; /* dense siblings: the twins of qwen3moe, qwen2moe */
extern const struct moetax_arch moetax_arch_qwen2;
extern const struct moetax_arch moetax_arch_olmoe;
extern const struct moetax_arch moetax_arch_llama; /* Mixtral: llama with experts (or a dense llama) */

/* Reading "<arch>.<suffix>" keys: the first error is kept in st (later calls return def). */
struct arch_keys {
    const struct moetax_gguf *g;
    const char *arch;
    moetax_status st;
    bool dense; /* arch_gqa_hparams: a dense model (qwen3, qwen2, llama or olmoe without experts) */
};
int32_t arch_key_i(struct arch_keys *k, const char *suffix, int64_t def, bool required);
float arch_key_f(struct arch_keys *k, const char *suffix, float def); /* absent: def */
bool arch_key_bool(struct arch_keys *k, const char *suffix, bool def);
/* The RoPE / YaRN parameters every architecture derives the same way (llama.cpp's context
 * does it for all of them): freq base/scale, ext factor, the attention factor, betas and the
 * original context. Returns the YaRN mscale of the attention (deepseek2's kq_scale uses it;
 * 1 without YaRN). */
double arch_rope_hparams(struct moetax_model *m, struct arch_keys *k);
/* The routing and expert-count checks shared by every MoE architecture (layers from
 * first_moe on are MoE layers): MOETAX_ERR_FORMAT naming the key. Without MoE layers
 * (first_moe >= block_count) the expert hparams are cleared: a dense model. */
moetax_status arch_check_moe(struct moetax_model *m, int first_moe);

/* The keys every GQA architecture (qwen3moe, olmoe, llama) reads the same way, as llama.cpp's
 * generic loader does: context_length, embedding_length, block_count, attention.head_count,
 * head_count_kv (default head_count), key_length / value_length (default n_embd / n_head),
 * rope.dimension_count (default key_length), feed_forward_length (default 0), expert_count
 * and expert_used_count (required), attention.layer_norm_rms_epsilon (required); checked:
 * head_count_kv divides head_count, key_length = value_length = rope.dimension_count (even,
 * 2..MOETAX_ROPE_MAX_DIMS; llama.cpp's graphs for all three assert it) and expert_count > 0.
 * With k->dense the expert keys are not read and every layer is a dense FFN
 * (n_layer_dense_lead = n_layer, feed_forward_length > 0 checked).
 * Sets attn = GQA; the caller sets RoPE mode, q/k norm, routing and the expert width. */
moetax_status arch_gqa_hparams(struct moetax_model *m, struct arch_keys *k);
/* The last steps of every GQA architecture's hparams: RoPE scaling keys, the attention scale
 * 1/sqrt(key_length), the first key error, then moetax_hparams_check. */
moetax_status arch_gqa_finish(struct moetax_model *m, struct arch_keys *k);

/* Bind tensor `name` with the expected shape (ggml order); absent and !required leaves
 * w->data NULL. */
moetax_status arch_bind(struct moetax_model *m, struct moetax_weight *w, const char *name, bool required,
                        int n_dims, int64_t ne0, int64_t ne1, int64_t ne2);
/* A vector tensor of n values as an owned F32 copy (absent and !required: *out = NULL). */
moetax_status arch_bind_vec(struct moetax_model *m, float **out, const char *name, bool required, int64_t n);
/* Zeroed memory freed with the model. */
void *arch_own(struct moetax_model *m, size_t bytes);
/* Layer il's FFN tensors (after attention): ffn_norm, then a dense SwiGLU FFN (!l->is_moe,
 * width from feed_forward_length, scalar or per layer) or the router, routed experts (gate
 * and up, or fused gate_up) and the shared experts (hp->n_ff_shexp wide, or n_expert_shared *
 * n_ff_exp) when that width is > 0. */
moetax_status arch_bind_ffn(struct moetax_model *m, int il);

#endif
