/* gqa.h - grouped-query attention over the paged KV cache (qwen3moe, qwen2moe, olmoe, Mixtral; see gqa.c): the
 * attention stage's own buffers and its entry points, the same as MLA's (mla.h). Internal. */
#ifndef MOETAX_GQA_H
#define MOETAX_GQA_H

#include "attn/attend.h"
#include "model/step.h"
#include "moetax/kvcache.h"

/* per-worker scratch of attention */
struct gqa_worker {
    float *sc;  /* attend_scratch_floats(n_head, hv): attend's scratch (at) */
    float *row; /* [attend_cell_row_floats(kv_row)] a cache row before its conversion (F16 / Q8_0 cells) */
    float *vb;  /* attend_cells_floats(hk, hv, rows): a chunk's K and V of one KV head (F16 / Q8_0 cells) */
    struct attend_scratch at;
    /* a prompt's tiles (gqa.c, phase 4; attend_tile) */
    float *tbuf;               /* attend_tile_floats(nq, hv), nq = max(ATTEND_TILE_ROWS, r) rows */
    struct attend_tile_scratch tile;
    float *tq;                 /* [nq][hk] a tile's queries of one KV head */
    int64_t *start;            /* [U + 1] the micro-batch's tiles (attend_tiles) */
};

struct gqa {
    struct moetax_kvcache *kv; /* not owned; a cell's row per layer is kv_row values */
    int64_t kv_row;            /* Hkv*hk + Hkv*hv: [K of every KV head ; V of every KV head] */
    enum moetax_type ct;       /* the cache's cells: F32, F16 or Q8_0 */
    /* micro-batch buffers (U = n_ubatch) */
    float *q;              /* [U, H*hk] */
    float *kvp;            /* [U, kv_row] k and v projections, the cache row's layout */
    float *attv;           /* [U, H*hv] attention outputs, heads concatenated */
    float *out;            /* [U, d] W_o output before the residual add */
    float *ropecs;         /* [U, n_rot] cos/sin of each token's position */
    /* chunks of positions made apart (gqa.c, split_chunks): per item (token, chunk) every head's
     * weighted sum, max and divisor, up to sp_cap items */
    float *sp_o;           /* [sp_cap, H, hv] */
    float *sp_ms;          /* [sp_cap, H, 2] */
    int64_t sp_cap;
    struct gqa_worker *wk; /* [n_threads] */
    int n_threads;
};

moetax_status gqa_init(struct gqa *a, const struct fw_step *s, struct moetax_kvcache *kv);
void gqa_free(struct gqa *a);
/* The floats of a cache row per layer for this model's GQA. */
int64_t gqa_kv_row(const struct moetax_hparams *hp);
/* Token t's rope cos/sin for its position s->pos[t] (any worker, own tokens). */
void gqa_rope_token(struct gqa *a, const struct fw_step *s, int64_t t);
/* Layer il: x += W_o attention(attn_norm(x)), each token over its own sequence's cached
 * positions 0 .. pos (its own row written first); uses phases, ends with a barrier. The
 * tokens' cells must be reserved (moetax_kvcache_reserve). */
void gqa_attention(struct worker *w, struct gqa *a, int il);

#endif
