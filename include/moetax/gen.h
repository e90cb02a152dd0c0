/*
 * moetax/gen.h - random-weight MoE models (deepseek2, qwen3moe, qwen2moe, olmoe, Mixtral) in llama.cpp's
 * GGUF layout.
 *
 * DESIGN
 *   A model is described by struct moetax_gen_params (every shape knob, the
 *   routing style, the weight type, the seed). moetax_gen_write streams it to
 *   a GGUF file tensor by tensor, never holding more than one chunk of values.
 *   Keys, tensor names and shapes follow shared/docs/GGUF-MOE.md (deepseek2) and llama.cpp's
 *   qwen3moe loader (attn_q/k/v, per-head attn_q_norm/attn_k_norm {head_dim}, every layer MoE,
 *   no shared expert; the MLA, dense-lead, shared-expert and group knobs do not apply to it),
 *   llama.cpp's olmoe loader (the same GQA tensors, full-width attn_q_norm {H*head_dim} /
 *   attn_k_norm {Hkv*head_dim}, experts olmoe.feed_forward_length wide, routing not
 *   renormalised; head_dim = n_embd / n_head as OLMoE's converter implies, and llama.cpp loads
 *   the file only with head_count_kv = head_count) and its llama loader for Mixtral
 *   (general.architecture "llama", no q/k norms, experts llama.feed_forward_length wide, merged
 *   ffn_{gate,up,down}_exps, llama.vocab_size and rope.dimension_count written as the
 *   converter does). All three: every layer MoE, no shared expert; the vocabulary is the same
 *   byte-level BPE one (Mixtral's own is SentencePiece). qwen2moe as llama.cpp's qwen2moe loader:
 *   the GQA tensors without q/k norms plus attn_{q,k,v}.bias, every layer MoE (softmax top-k not
 *   renormalised), one shared expert n_ff_shexp wide (expert_shared_feed_forward_length; also
 *   written as feed_forward_length, as Qwen's intermediate_size) gated by ffn_gate_inp_shexp {d};
 *   n_head * head_dim = n_embd (llama.cpp binds attn_q and attn_output {n_embd, n_embd}).
 *
 * INVARIANTS
 *   - Deterministic: the same params and seed give the same bytes. Each tensor's
 *     values come from an RNG seeded by (seed, tensor name), so they do not
 *     depend on the order or chunking of the write.
 *   - Router (ffn_gate_inp), norms and exp_probs_b stay F32 whatever the weight
 *     type, as llama.cpp's quantizer does; a quantized tensor whose first
 *     dimension is not a multiple of 32 is stored F16 (llama-quantize falls back
 *     the same way).
 *   - Weights are scaled by 1/sqrt(fan_in) so activations stay O(1) through all
 *     layers, and the router's logits have unit spread so routing does not
 *     collapse onto a few experts.
 *   - A dense twin (dense_twin = true) has the same attention and leading dense
 *     layers, and in place of every MoE layer a dense SwiGLU FFN of width
 *     n_expert_used * n_ff_exp + n_expert_shared * n_ff_exp (+ n_ff_shexp for qwen2moe,
 *     whose twin drops the shared expert's gate): the same active parameters per token.
 *     It is written as the dense architecture llama.cpp has for it: deepseek2 (all layers
 *     leading dense), qwen3 (qwen3moe's twin), qwen2 (qwen2moe's), llama without experts
 *     (Mixtral's); olmoe has no dense sibling in llama.cpp, so its twin is an olmoe file
 *     without expert keys, which moetax runs and llama.cpp refuses.
 */
#ifndef MOETAX_GEN_H
#define MOETAX_GEN_H

#include <stdbool.h>
#include <stdint.h>

#include "moetax/status.h"
#include "moetax/types.h"

#ifdef __cplusplus
extern "C" {
#endif

enum moetax_gen_arch {
    MOETAX_GEN_DEEPSEEK2 = 0,
    MOETAX_GEN_QWEN3MOE = 1,
    MOETAX_GEN_OLMOE = 2,
    MOETAX_GEN_MIXTRAL = 3, /* general.architecture "llama" with experts */
    MOETAX_GEN_QWEN2MOE = 4,
};

struct moetax_gen_params {
    enum moetax_gen_arch arch; /* general.architecture */
    const char *name;          /* general.name */
    int n_vocab;
    int n_ctx;                 /* context_length */
    int n_embd;                /* d */
    int n_layer;
    int n_layer_dense_lead;    /* leading_dense_block_count */
    int n_ff;                  /* dense FFN width */
    int n_head;
    int q_lora_rank;           /* 0: plain attn_q (Lite shapes) */
    int kv_lora_rank;
    int n_embd_head_qk_nope;
    int n_embd_head_qk_rope;   /* rope.dimension_count */
    int n_embd_head_v;
    int n_head_kv;             /* GQA archs: attention.head_count_kv */
    int n_embd_head;           /* GQA archs: head_dim (key_length = value_length = rope dims); olmoe: 0
                                  or n_embd / n_head */
    int n_expert;
    int n_expert_used;
    int n_expert_shared;
    int n_ff_exp;              /* expert_feed_forward_length (olmoe, Mixtral: written as feed_forward_length) */
    int n_ff_shexp;            /* qwen2moe: expert_shared_feed_forward_length, the gated shared expert's width */
    int n_expert_group;        /* 0/1: no group-limited routing */
    int n_expert_group_used;
    int gating_func;           /* 1 softmax, 2 sigmoid */
    bool exp_probs_b;          /* V3 selection bias */
    bool expert_weights_norm;
    float expert_weights_scale;
    float rope_freq_base;
    float rope_yarn_factor;    /* 0: no rope scaling */
    int rope_yarn_orig_ctx;
    float rope_yarn_log_mul;
    float rms_eps;
    bool fused_gate_up;        /* ffn_gate_up_exps instead of gate/up */
    bool kv_b_merged;          /* older attn_kv_b instead of attn_k_b/attn_v_b */
    bool dense_twin;           /* see above */
    enum moetax_type wtype;    /* F32, F16, BF16, Q8_0, Q4_0 */
    uint64_t seed;
};

/* Fill p with a named preset: deepseek2 "tiny", "tiny-v3", "small", "bench-v3", "v2-lite".
 * Returns MOETAX_ERR_ARG for an unknown name. */
moetax_status moetax_gen_preset(const char *preset, struct moetax_gen_params *p);
/* The same for an architecture: qwen3moe, qwen2moe, olmoe and mixtral have "tiny" and "small". */
moetax_status moetax_gen_preset_arch(enum moetax_gen_arch arch, const char *preset, struct moetax_gen_params *p);
/* "deepseek2" / "qwen3moe" / "qwen2moe" / "olmoe" / "mixtral" to the enum; false if unknown. */
bool moetax_gen_arch_from_name(const char *name, enum moetax_gen_arch *out);
/* The option's name ("mixtral" for MOETAX_GEN_MIXTRAL). */
const char *moetax_gen_arch_name(enum moetax_gen_arch arch);
/* general.architecture the file gets ("llama" for MOETAX_GEN_MIXTRAL). */
const char *moetax_gen_arch_gguf(enum moetax_gen_arch arch);
/* general.architecture of its dense twin ("qwen3", "qwen2", else as moetax_gen_arch_gguf). */
const char *moetax_gen_twin_arch_gguf(enum moetax_gen_arch arch);
/* Check shapes and options; the message names the offending knob. */
moetax_status moetax_gen_validate(const struct moetax_gen_params *p);
/* Total parameter count and file size (bytes of tensor data). */
void moetax_gen_size(const struct moetax_gen_params *p, uint64_t *n_params, uint64_t *n_bytes);
/* the most parameters a generated model may have (2^40: above any real MoE model); moetax_gen_write
 * refuses more, and moetax_gen_size saturates at UINT64_MAX instead of wrapping */
#define MOETAX_GEN_MAX_PARAMS ((uint64_t)1 << 40)

typedef void (*moetax_gen_progress_fn)(void *user, uint64_t bytes_done, uint64_t bytes_total);
moetax_status moetax_gen_write(const struct moetax_gen_params *p, const char *path,
                               moetax_gen_progress_fn progress, void *user);

/* Build a byte-level BPE vocabulary of exactly n_vocab tokens (GPT-2 byte
 * encoding; merges learned on a built-in English+Python text; two control
 * tokens BOS/EOS; unused padding tokens if the text runs out of merges).
 * Arrays are malloc'd; free with moetax_gen_vocab_free. */
struct moetax_gen_vocab {
    int n_tokens;
    char **tokens;
    int32_t *token_type; /* 1 normal, 3 control, 5 unused, 6 byte */
    int n_merges;
    char **merges;       /* "left right" */
    int bos_id, eos_id;
};
moetax_status moetax_gen_vocab_build(int n_vocab, struct moetax_gen_vocab *v);
void moetax_gen_vocab_free(struct moetax_gen_vocab *v);

#ifdef __cplusplus
}
#endif
#endif
