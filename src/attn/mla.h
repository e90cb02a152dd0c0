/* mla.h - DeepSeek2 Multi-head Latent Attention over the paged KV cache: the
 * attention stage's own buffers and its entry points (see mla.c). Internal. */
#ifndef MOETAX_MLA_H
#define MOETAX_MLA_H

#include "attn/attend.h"
#include "model/step.h"
#include "moetax/kvcache.h"

/* The decompressed prefill (mla.c, dec_head): queries per tile, positions per decompression
 * call (its rows packed once by the float tiles), and how many times as many multiply-adds a
 * second the integer tiles make as the float ones (dec_pays' model). */
enum { MLA_DEC_TILE = 16, MLA_DEC_ROWS = 64 };
#define MLA_DEC_INT_SPEED 3.0
/* The decompressed form when its multiply-adds are below this share of the absorbed form's (at 0.8, the
 * V2-Lite shape's forms ran alike, at 0.73 the trained default model's absorbed form was faster). */
#define MLA_DEC_MARGIN 0.7

/* per-worker scratch of attention */
struct mla_worker {
    float *f;  /* [nf] gathered q_nope / a head group's o (one token) / gathered o of a head */
    size_t nf;
    float *atbuf;            /* attend_scratch_floats(n_head, kv_lora) */
    struct attend_scratch at; /* attend's scratch in atbuf and vb */
    void *q;   /* [nq] prepared rows for the per-head matmuls */
    size_t nq;
    float *row; /* [attend_cell_row_floats(kv_row)] a cache row before its conversion (F16 / Q8_0 cells) */
    float *vb;  /* attend_cells_floats(kv_row, kv_lora, max(heads, ATTEND_TILE_ROWS)): a chunk's cells (F16 / Q8_0 cells) */
    /* a prompt's tiles in the absorbed form (mla.c, phase 4; attend_tile) */
    float *tbuf;               /* attend_tile_floats(max(ATTEND_TILE_ROWS, n_head), kv_lora) */
    struct attend_tile_scratch tile;
    int64_t *start;            /* [U + 1] the micro-batch's tiles (attend_tiles) */
    /* decompressed prefill (mla.c, dec_head; NULL unless struct mla's dec) */
    float *wkt;  /* [nope][kv_lora] W_kb[h] transposed */
    float *wv;   /* [v_head][kv_lora] W_vb[h] */
    float *g;    /* [MLA_DEC_ROWS][max(kv_lora, nope)] kv rows of a chunk's positions (first a weight's row) */
    float *kc;   /* [ATTEND_CHUNK][nope + rope] its keys */
    float *vc;   /* [ATTEND_CHUNK][v_head] its values */
    float *qt;   /* [DEC_TILE][nope + rope] a tile's queries */
    float *sc;   /* [DEC_TILE][ATTEND_CHUNK] their scores, then probabilities */
    float *oc;   /* [DEC_TILE][v_head] a later chunk's weighted sums */
    float *ms;   /* [DEC_TILE][2] the chunk's max and divisor */
    float *run;  /* [U][2] the running ones */
};

struct mla {
    struct moetax_kvcache *kv; /* not owned; a cell's row per layer is kv_row floats */
    enum moetax_attn_prefill dec_mode; /* the context's attn_prefill */
    bool dec;                  /* a prompt's micro-batch may take the decompressed form (dec_pays) */
    int64_t kv_row;            /* kv_lora + rope */
    enum moetax_type ct;       /* the cache's cells: F32, F16 or Q8_0 */
    /* micro-batch buffers (U = n_ubatch) */
    float *qa;             /* [U, q_lora] */
    float *q;              /* [U, H*(nope+rope)] */
    float *kva;            /* [U, kv_lora + rope] */
    float *qabs;           /* [U, H, kv_lora + rope] */
    float *attv;           /* [U, H*v_head] */
    float *oatt;           /* [U, H, kv_lora] attention outputs before W_vb (batches) */
    float *out;            /* [U, d] W_o output before the residual add */
    float *ropecs;         /* [U, rope] cos/sin of each token's position (once per micro-batch) */
    /* chunks of positions made apart (mla.c, split): per item (token, chunk) all heads' weighted
     * sums, maxima and divisors, up to sp_cap items */
    float *sp_o;           /* [sp_cap, H, kv_lora] */
    float *sp_ms;          /* [sp_cap, H, 2] */
    int64_t sp_cap;
    struct mla_worker *wk; /* [n_threads] */
    int n_threads;
};

/* Buffers for micro-batches of s->n_ubatch tokens over a cache of up to
 * n_cells positions per sequence; prefill: whether a prompt's micro-batches may take the
 * decompressed form (moetax_ctx_params.attn_prefill). */
moetax_status mla_init(struct mla *a, const struct fw_step *s, struct moetax_kvcache *kv,
                       enum moetax_attn_prefill prefill);
void mla_free(struct mla *a);
/* Token t's rope cos/sin for its position s->pos[t] (any worker, own tokens). */
void mla_rope_token(struct mla *a, const struct fw_step *s, int64_t t);
/* Layer il: from the residual s->x (attn_norm'd into s->xn, prepared in s->a_in)
 * to x += W_o attention(x); each token attends over its own sequence's cached
 * positions 0 .. pos (its own row written first); uses phases, ends with a
 * barrier. The tokens' cells must be reserved (moetax_kvcache_reserve). */
void mla_attention(struct worker *w, struct mla *a, int il);

#endif
