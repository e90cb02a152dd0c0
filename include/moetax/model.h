/*
 * moetax/model.h - an MoE model (deepseek2, qwen3moe: src/model/arch_*.c) bound from GGUF, and an inference context
 * (KV cache, buffers, thread pool) that evaluates tokens.
 *
 * DESIGN
 *   moetax_model_load maps the file (moetax_gguf_open) and binds every tensor
 *   in place: resident weights are not copied, except those of a type the
 *   kernel table reads in a repacked layout (Q4_0 with the avx2 table, see
 *   moetax/kernels.h): they are copied once into a private buffer in that
 *   layout (the same number of bytes; the mapped pages are released), the
 *   routed experts only when a context runs without an expert store (the store
 *   repacks each expert it reads instead). The token embedding is read by rows
 *   with moetax_to_float and stays as stored (a tied output matrix gets its
 *   own repacked copy). With no_mmap (moetax_model_load_ex, like llama.cpp's
 *   --no-mmap, though the copy is made from the mapping) every resident weight
 *   the kernels read is copied (repacked types as always, the others as stored)
 *   into private memory advised into 2 MiB pages, and so are the routed experts
 *   when a context runs without an expert store: a file whose pages sit in the page cache in small folios
 *   (a freshly written file, say) is then read as fast as the machine allows;
 *   moetax_model_weight_pages tells how the weights are paged. Each tensor's shape is checked
 *   against the shape the metadata implies; a mismatch names the tensor and
 *   both shapes. Small vectors (norms, biases) are converted to owned F32
 *   copies; the older merged attn_kv_b is split once into attn_k_b / attn_v_b
 *   (F32) so there is one attention path.
 *
 *   A context holds many sequences in one KV cache (moetax/kvcache.h: n_ctx
 *   cells in all, in blocks) and evaluates a batch (struct moetax_batch) of
 *   tokens of any of them, each at its sequence's next position: prompt
 *   chunks and single decode tokens mixed. It runs with one moetax_pool_run
 *   per micro-batch: all workers walk the same sequence of phases, split by
 *   (ith, nth) or atomic chunk counters, separated by barriers only where the
 *   data dependencies demand one (counted per layer in src/model/forward.c).
 *   Attention runs per token over its own sequence's cache; the MoE block
 *   routes all tokens of the micro-batch at once and reads each expert once.
 *   moetax_ctx_eval is the one-sequence form (sequence 0).
 *
 *   MLA attention runs in the absorbed form: only [kv_norm ; k_pe] (kv_lora +
 *   rope values) is cached per token and layer. The MoE block routes all tokens
 *   of the micro-batch at once, builds one dispatch plan (rows grouped by
 *   expert), and runs every (expert, row block) of gate/up and down as a work
 *   item; the down items own disjoint output rows, so the weighted combine is
 *   done in place, into the residual, without a separate pass or atomics.
 *
 * INVARIANTS
 *   - The cells in use never exceed n_ctx; a batch whose tokens would not fit
 *     returns MOETAX_ERR_LIMIT and evaluates nothing (the sequences in the
 *     cache are untouched).
 *   - Results do not depend on the number of threads beyond float summation
 *     order inside kernels (each output element is computed by one worker).
 *   - A token's logits do not depend on the other sequences of its batch:
 *     attention reads only its own sequence, and every other stage computes
 *     each token's row the same way whatever rows share the matmul (the
 *     kernels are batch-invariant for Q8_0/Q4_0 weights; see test_batch.c
 *     for the types where the batch path and the one-token path differ).
 *   - The model must outlive its contexts.
 */
#ifndef MOETAX_MODEL_H
#define MOETAX_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moetax/gguf.h"
#include "moetax/status.h"
#include "moetax/types.h"

#ifdef __cplusplus
extern "C" {
#endif

struct moetax_pool;
struct moetax_arch;

/* The attention an architecture runs (src/attn/): MLA (deepseek2) or grouped-query. */
enum moetax_attn_kind {
    MOETAX_ATTN_MLA = 0,
    MOETAX_ATTN_GQA = 1,
};

/* Where a GQA architecture applies its q/k RMSNorm (before RoPE). */
enum moetax_qk_norm {
    MOETAX_QK_NORM_NONE = 0,
    MOETAX_QK_NORM_HEAD = 1, /* per head over head_dim: attn_q_norm / attn_k_norm {head_dim} (qwen3moe) */
    MOETAX_QK_NORM_FULL = 2, /* over all heads' values: attn_q_norm {H*head_dim}, attn_k_norm {Hkv*head_dim} (olmoe) */
};

struct moetax_hparams {
    char arch[32];
    enum moetax_attn_kind attn;
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t n_embd;              /* d */
    int32_t n_layer;
    int32_t n_layer_dense_lead;
    int32_t n_ff;                /* dense FFN width */
    int32_t n_head;              /* H */
    int32_t q_lora_rank;         /* 0: plain attn_q */
    int32_t kv_lora_rank;
    int32_t n_embd_head_qk_nope;
    int32_t n_embd_head_qk_rope; /* rotated dims */
    int32_t n_embd_head_v;       /* MLA: v head; GQA: V head dim */
    /* GQA (attention.head_count_kv, key_length, rope.dimension_count; 0 for MLA) */
    int32_t n_head_kv;           /* Hkv: query head h reads KV head h / (H / Hkv) */
    int32_t n_embd_head_k;       /* K (and Q) head dim */
    int32_t n_rot;               /* rotated dims per head (MLA: n_embd_head_qk_rope) */
    int32_t rope_mode;           /* enum moetax_rope_mode (moetax/kernels.h): NORM or NEOX */
    enum moetax_qk_norm qk_norm;
    int32_t n_expert;            /* E (0: dense model) */
    int32_t n_expert_used;       /* k */
    int32_t n_expert_shared;
    int32_t n_ff_exp;            /* expert width F */
    int32_t n_ff_shexp;          /* the shared experts' merged width: 0 = n_expert_shared * n_ff_exp (deepseek2);
                                    qwen2moe: expert_shared_feed_forward_length */
    int32_t n_expert_group;      /* <= 1: no group limit */
    int32_t n_expert_group_used;
    int32_t gating_func;         /* 1 softmax, 2 sigmoid */
    bool expert_weights_norm;
    float expert_weights_scale;  /* 0 or 1: none */
    float rms_eps;
    /* rope (ggml's parameters, derived from the metadata as llama.cpp does) */
    float rope_freq_base;
    float rope_freq_scale;
    float rope_ext_factor;
    float rope_attn_factor;
    float rope_beta_fast, rope_beta_slow;
    int32_t rope_n_ctx_orig;
    float kq_scale;              /* MLA: mscale^2 / sqrt(nope + rope); GQA: 1 / sqrt(head_dim k) */
};

/* The one set of rules for the float hyper-parameters (src/model/hparams.c),
 * applied by the loader to what it derived from a file and by `moetax gen` to
 * what it writes: eps, rope base/scale/YaRN factors, attention scale and (with
 * experts) expert_weights_scale must be finite and in range. MOETAX_ERR_FORMAT
 * names `where` (a path), the metadata key, the value and the range. */
moetax_status moetax_hparams_check(const struct moetax_hparams *hp, const char *where);

/* A weight: 2-D {ncols, nrows} or 3-D {ncols, nrows, n_mat} in ggml order. */
struct moetax_weight {
    const void *data;       /* NULL if absent; in the layout the kernels read (see DESIGN) */
    const void *file_data;  /* the same bytes as stored in the mapped file (GGUF layout), or NULL
                               if the weight is not a file tensor (e.g. the split attn_kv_b) */
    enum moetax_type type;
    int64_t ne[3];
    size_t row_bytes;       /* bytes of one row of ne[0] values */
    size_t mat_bytes;       /* bytes of one matrix (ne[1] rows) */
};

struct moetax_layer {
    bool is_moe;
    float *attn_norm;                       /* [d] */
    struct moetax_weight wq;                /* MLA: {d, H*(nope+rope)} when q_lora_rank == 0; GQA: {d, H*hk} */
    struct moetax_weight wk, wv;            /* GQA: {d, Hkv*hk}, {d, Hkv*hv} */
    float *attn_q_norm, *attn_k_norm;       /* GQA: [hk] per head or [H*hk] / [Hkv*hk] full width, or NULL */
    float *bq, *bk, *bv;                    /* GQA: [H*hk], [Hkv*hk], [Hkv*hv] q/k/v biases (qwen2moe) or NULL */
    struct moetax_weight wq_a;              /* {d, q_lora} */
    float *q_a_norm;                        /* [q_lora] */
    struct moetax_weight wq_b;              /* {q_lora, H*(nope+rope)} */
    struct moetax_weight wkv_a;             /* {d, kv_lora + rope} */
    float *kv_a_norm;                       /* [kv_lora] */
    struct moetax_weight wk_b;              /* {nope, kv_lora, H} */
    struct moetax_weight wv_b;              /* {kv_lora, v_head, H} */
    struct moetax_weight wo;                /* {H*v_head, d} (GQA: {H*hv, d}) */
    float *ffn_norm;                        /* [d] */
    /* dense FFN */
    struct moetax_weight ffn_gate, ffn_up;  /* {d, n_ff} */
    struct moetax_weight ffn_down;          /* {n_ff, d} */
    /* MoE */
    struct moetax_weight gate_inp;          /* {d, E} router */
    float *exp_probs_b;                     /* [E] selection bias or NULL */
    struct moetax_weight gate_exps, up_exps;/* {d, F, E} (fused: gate_up_exps {d, 2F, E}) */
    bool fused_gate_up;
    struct moetax_weight down_exps;         /* {F, d, E} */
    struct moetax_weight gate_sh, up_sh;    /* {d, F*n_shared} */
    struct moetax_weight down_sh;           /* {F*n_shared, d} */
    float *gate_inp_shexp;                  /* [d] qwen2moe: the shared FFN's output is scaled per token by
                                               sigmoid(gate_inp_shexp . x), x the ffn-normed input; or NULL */
};

struct moetax_model {
    struct moetax_gguf *gguf;
    struct moetax_hparams hp;
    struct moetax_weight tok_embd;          /* {d, n_vocab} */
    float *output_norm;                     /* [d] */
    struct moetax_weight output;            /* {d, n_vocab} (token_embd if absent) */
    struct moetax_layer *layers;            /* [n_layer] */
    bool has_q8_0, has_q4_0;                /* activation preparations needed */
    bool has_kq;                            /* k-quant weights: block_q8_K rows prepared too */
    const struct moetax_arch *arch;         /* internal: the architecture that bound it (src/model/arch.h) */
    void *owned;                            /* internal: owned F32 copies */
};

moetax_status moetax_model_load(const char *path, struct moetax_model **out);
struct moetax_model_params {
    bool no_mmap; /* copy the weights read by the kernels into private 2 MiB pages (see DESIGN) */
    /* Routed experts re-quantized in memory at load to this type (F16, BF16, Q8_0, Q4_0,
     * Q4_K, Q5_K, Q6_K; src/model/requant.h), the rest as stored: what a file whose expert
     * tensors `moetax quantize` converted computes, bit for bit. Such experts have no file
     * bytes, so an expert store is refused. MOETAX_EXPERT_TYPE_AS_STORED (0): as stored. */
    enum moetax_type expert_type;
};
#define MOETAX_EXPERT_TYPE_AS_STORED MOETAX_TYPE_F32 /* experts are never widened to F32 this way */
moetax_status moetax_model_load_ex(const char *path, const struct moetax_model_params *p, struct moetax_model **out);
/* The same from a GGUF image in memory (not copied; must outlive the model; any
 * alignment): hyper-parameters, tensor binding and all, for tests and fuzzing. */
moetax_status moetax_model_load_memory(const void *buf, size_t size, const struct moetax_model_params *p,
                                       struct moetax_model **out);
/* How the weights the kernels read are paged now: the file mapping and the
 * private copies (repacked or no_mmap), each mapping whole (moetax_mem_pages).
 * *resident: their bytes in memory; *huge: of those, in 2 MiB pages. Errors
 * as moetax_mem_pages. */
moetax_status moetax_model_weight_pages(const struct moetax_model *m, uint64_t *resident, uint64_t *huge);
void moetax_model_free(struct moetax_model *m);
/* True for a routed-expert tensor (name contains "_exps.": ffn_{gate,up,down,gate_up}_exps). */
bool moetax_tensor_is_routed_expert(const struct moetax_gguf_tensor *t);

/* Fault tensors into memory now (best effort, when they fit in half the free
 * RAM): the resident part (routed_experts = false; done by moetax_model_load)
 * or the routed experts. Tensors read through a repacked copy are skipped. */
void moetax_model_prefault(const struct moetax_model *m, bool routed_experts);
/* Make the routed experts ready to be read through the mapping, as a context
 * without an expert store does (moetax_ctx_init calls it): the ones the
 * kernels read repacked are copied once into a private repacked buffer (as
 * many bytes as they take in the file; done at most once per model,
 * thread-safe), the others are prefaulted. MOETAX_ERR_NOMEM if the copy does
 * not fit: run with an expert store then. */
moetax_status moetax_model_prepare_experts(const struct moetax_model *m);
/* This process reads only routed experts [lo, hi) of every MoE layer (expert parallelism: a
 * rank's own experts). Before moetax_model_prepare_experts: the others are neither repacked
 * nor prefaulted (their addresses stay valid but must not be read). MOETAX_ERR_ARG if the
 * range is empty or outside [0, n_expert), or the experts are already prepared. */
moetax_status moetax_model_set_expert_range(struct moetax_model *m, int32_t lo, int32_t hi);
/* The general form (a placement: src/dist/dist.h): own [n_layer, n_expert], nonzero for the
 * routed experts this process reads (copied). Same rules as moetax_model_set_expert_range. */
moetax_status moetax_model_set_expert_owned(struct moetax_model *m, const uint8_t *own);
/* Whether this process reads routed expert e of layer il (true for all without a set). */
bool moetax_model_expert_owned(const struct moetax_model *m, int il, int e);

/* Open an expert store over the model's routed experts (every MoE layer's
 * gate/up/down rows of each expert registered as file ranges) with the given
 * parameters (path defaults to the model's file; when the kernels read a
 * routed expert type repacked, on_load is set to repack each expert read).
 * The micro-batch is fitted to the budget: *n_ubatch_out <= n_ubatch such that
 * every expert one layer can use for it fits at once; a budget smaller than
 * one token's experts is an error that names the minimum. */
struct moetax_store;
struct moetax_store_params;
moetax_status moetax_model_store_open(const struct moetax_model *m, const struct moetax_store_params *sp,
                                      int n_ubatch, int n_expert_used, struct moetax_store **out,
                                      int *n_ubatch_out);
/* The budget of an expert store that holds every routed expert this process reads: that many slots,
 * each the size moetax_model_store_open gives them (the largest expert, as 4096-aligned spans). 0 when
 * the model has no routed experts or they cannot be registered. A budget in % is a share of this. */
uint64_t moetax_model_store_bytes_all(const struct moetax_model *m);
/* MOETAX_OK where moetax_model_store_open would accept budget bytes for n_expert_used experts per token
 * (0: the model's), else its error (the slots the budget holds, and the least budget that works), without
 * opening a store: for a command that checks its budgets before the work. */
moetax_status moetax_model_store_check_budget(const struct moetax_model *m, uint64_t budget, int n_expert_used);
/* Check a run-time top-k for this model: 1..n_expert, and no more than the
 * experts of the groups a token may use (group-limited routing). 0 means the
 * model's expert_used_count and is always valid. MOETAX_ERR_ARG names the
 * range otherwise. */
moetax_status moetax_model_check_experts_used(const struct moetax_model *m, int n_expert_used);
/* Bytes of weights a decoded token reads (routed experts k/E, one embedding row). */
double moetax_model_active_bytes(const struct moetax_model *m);
/* The same with n_expert_used routed experts per token (0: the model's). */
double moetax_model_active_bytes_k(const struct moetax_model *m, int n_expert_used);

enum moetax_overflow { MOETAX_OVERFLOW_DROP = 0, MOETAX_OVERFLOW_REROUTE = 1 };

/* Tokens per micro-batch unless a context says otherwise (llama.cpp's n_ubatch too): a prompt's
 * expert matrices and attention weights are read once per micro-batch. */
#define MOETAX_UBATCH_DEFAULT 512

/* How MLA (DeepSeek2) attends in a micro-batch of one sequence's prompt tokens. The absorbed
 * form works on the compressed cache rows, as decode does: a prompt's logits are then the same
 * bits however it is cut into micro-batches, batched with other sequences or fed token by token.
 * The decompressed form first makes each head's keys and values of every position (llama.cpp's
 * and ik_llama.cpp's way for prompts): fewer operations once a micro-batch holds enough tokens of
 * a long prompt, the same mathematics with other float sums (and no quantized activations in the
 * attention), so those bits then depend on how the prompt is cut. */
enum moetax_attn_prefill {
    MOETAX_ATTN_PREFILL_ABSORBED = 0, /* always absorbed (the default) */
    MOETAX_ATTN_PREFILL_AUTO,         /* decompressed where it takes fewer operations */
    MOETAX_ATTN_PREFILL_DECOMPRESSED, /* every micro-batch of 2+ tokens of one sequence (tests) */
};

struct moetax_ctx_params {
    int32_t n_ctx;            /* KV cache cells, all sequences together (rounded up to whole
                                 blocks); 0: min(n_ctx_train, 4096) */
    int32_t n_seq_max;        /* sequence ids 0 .. n_seq_max-1; 0: MOETAX_KV_SEQ_MAX_DEFAULT */
    int32_t kv_block;         /* KV cache cells per block; 0: MOETAX_KV_BLOCK_DEFAULT */
    enum moetax_type kv_type; /* KV cache cells: MOETAX_TYPE_F32 (0, the default), MOETAX_TYPE_F16 (half the
                                 memory, llama.cpp's default; then no longer llama.cpp's F32 bits) or
                                 MOETAX_TYPE_Q8_0 (a quarter; GQA heads of multiples of 32 values) */
    int32_t n_ubatch;         /* max tokens per micro-batch; 0: MOETAX_UBATCH_DEFAULT */
    enum moetax_attn_prefill attn_prefill; /* MLA prompts: see enum moetax_attn_prefill */
    int32_t n_threads;        /* 0: online CPUs (ignored when pool is given) */
    struct moetax_pool *pool; /* optional shared pool (not owned) */
    struct moetax_store *store; /* optional expert store (not owned; see moetax_model_store_open):
                                   routed experts are read through it instead of the mapping */
    bool no_prefetch;           /* with a store: read each expert only when a work item needs it (no early
                                   reads of a routed layer's experts, no cross-layer prediction) */
    float capacity_factor;      /* the batch lever (off: 0 or inf): each expert takes at most
                                   ceil(C x tokens x k / E) assignments of a micro-batch, those of the
                                   highest routing weights; the others go as `overflow` says. The ledger
                                   counts them (moetax_ledger_moe_stats) */
    enum moetax_overflow overflow; /* DROP: the token's remaining weights scaled back to its total;
                                      REROUTE: to its best other expert with room (else dropped) */
    bool check_finite;          /* check every token's hidden state after the embedding and each layer:
                                   the first NaN / inf is MOETAX_ERR_NUMERIC naming the layer (logits
                                   are always checked) */
    int32_t n_expert_used;      /* routed experts per token (run-time top-k): 0 = the model's
                                   expert_used_count; see moetax_model_check_experts_used. With a
                                   store, open it for the same count (moetax_model_store_open) */
    bool adapt_threads;         /* run each step on all threads or on half of them, whichever the
                                   measured step times say is faster: on a machine busy with other
                                   work, workers that wait at every barrier for a descheduled one
                                   make all threads slower than half (2 threads on 2 busy cores:
                                   several-fold). Every 16-256 steps one step tries the other
                                   count. Logits may then differ in the last bits from run to run
                                   where a model's results depend on the thread count */
};

struct moetax_ctx;
struct moetax_kvcache;

/* A batch: n_tokens entries of {token, position, sequence id, wants logits}. */
struct moetax_batch {
    int32_t n_tokens, capacity;
    int32_t *token;  /* [capacity] */
    int32_t *pos;    /* [capacity] position in its sequence: the sequence's next one */
    int32_t *seq;    /* [capacity] sequence id */
    bool *logits;    /* [capacity] keep this token's logits (moetax_ctx_logits_ith) */
};
moetax_status moetax_batch_init(struct moetax_batch *b, int32_t capacity);
void moetax_batch_free(struct moetax_batch *b);
void moetax_batch_clear(struct moetax_batch *b);
/* MOETAX_ERR_LIMIT when the batch is full. */
moetax_status moetax_batch_add(struct moetax_batch *b, int32_t token, int32_t pos, int32_t seq, bool logits);

moetax_status moetax_ctx_init(const struct moetax_model *m, const struct moetax_ctx_params *p,
                              struct moetax_ctx **out);
void moetax_ctx_free(struct moetax_ctx *c);
/* Forget every sequence. */
void moetax_ctx_reset(struct moetax_ctx *c);
/* Next position of sequence 0 (moetax_ctx_eval's), or of sequence seq. */
int64_t moetax_ctx_pos(const struct moetax_ctx *c);
int64_t moetax_ctx_seq_pos(const struct moetax_ctx *c, int32_t seq);
/* KV cache cells in all. */
int64_t moetax_ctx_n_ctx(const struct moetax_ctx *c);
int64_t moetax_ctx_n_ubatch(const struct moetax_ctx *c);
/* The context's KV cache, for its memory operations (remove, copy, keep a
 * sequence; free cells): moetax/kvcache.h. Not while a decode runs. */
struct moetax_kvcache *moetax_ctx_kv(struct moetax_ctx *c);
int moetax_ctx_n_threads(const struct moetax_ctx *c);
/* The threads steps run on now: n_threads, or fewer with adapt_threads. */
int moetax_ctx_threads_now(const struct moetax_ctx *c);
/* adapt_threads: the probe steps run and the switches of thread count they made
 * (MOETAX_ADAPT_THREADS_FORCE=1 in the environment makes every probe win, for tests). */
void moetax_ctx_adapt_stats(const struct moetax_ctx *c, int64_t *probes, int64_t *switches);
/* Routed experts per token of this context (its top-k). */
int moetax_ctx_n_expert_used(const struct moetax_ctx *c);
/* Record every step in a ledger (NULL: none). The ledger must have at least as
 * many workers as the context has threads, and outlive its use. */
struct moetax_ledger;
void moetax_ctx_set_ledger(struct moetax_ctx *c, struct moetax_ledger *l);
/* Test hook: every worker spins for ns nanoseconds each time it enters phase
 * `phase` (an int holding an enum moetax_phase); ns = 0 turns it off. */
void moetax_ctx_test_delay(struct moetax_ctx *c, int phase, uint64_t ns);
/* Bytes of the KV cache. */
size_t moetax_ctx_kv_bytes(const struct moetax_ctx *c);

/* Evaluate a batch (split into micro-batches of at most n_ubatch tokens).
 * Token ids, sequence ids and positions are checked first, and the cells of
 * the whole batch are reserved before any work. A step with one token per
 * sequence is booked as decode in the ledger, with the number of sequences as
 * its batch size. MOETAX_ERR_NUMERIC when a token's logits are not finite.
 * A batch that fails leaves the cache as it was (none of its positions added,
 * also where earlier micro-batches had run). */
moetax_status moetax_ctx_decode(struct moetax_ctx *c, const struct moetax_batch *b);
/* Logits [n_vocab] of entry i of the last decoded batch, NULL unless it asked for them. */
const float *moetax_ctx_logits_ith(const struct moetax_ctx *c, int32_t i);

/* One sequence (0): evaluate n tokens at its next position (split into micro-batches of at
 * most n_ubatch). logits: NULL, or [n, n_vocab] when all_logits, else [n_vocab]
 * for the last token. Token ids are checked against n_vocab. */
moetax_status moetax_ctx_eval(struct moetax_ctx *c, const int32_t *tokens, int64_t n, float *logits, bool all_logits);

/* Routing of the last evaluated micro-batch, for tests and the ledger:
 * experts[layer][t * k + j] and weights likewise (k = moetax_ctx_n_expert_used);
 * NULL for dense layers. With a capacity factor: after it, an expert of -1
 * (weight 0) for a dropped assignment. */
const int32_t *moetax_ctx_routing(const struct moetax_ctx *c, int layer, const float **weights, int64_t *n_tokens);

#ifdef __cplusplus
}
#endif
#endif
