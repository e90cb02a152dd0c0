/*
 * attend.h - one token's attention for a group of query heads over its sequence's cached
 * positions, shared by MLA (mla.c) and GQA (gqa.c).
 *
 * The positions 0 .. np-1 go in chunks of ATTEND_CHUNK (a constant: the results must not depend
 * on the thread count, the micro-batch or the cache's block size). Per chunk c, for every head:
 * the scores of the chunk's key rows (one matmul per cache block with the heads as its batch),
 * scaled, their softmax (max m_c, divisor l_c), and the softmax-weighted sum o_c of the chunk's
 * value rows (wsum, one chain over the chunk's blocks). The chunk's rows are read from memory once
 * for the scores and again from the core's own caches for the weighted sum, which a pass over all
 * positions (scores of every position first) read from memory twice. The chunks are merged in
 * order: with (M, Z, o) after chunks 0 .. c-1,
 *   M' = max(M, m_c), a = Z exp(M - M'), b = l_c exp(m_c - M'), Z' = a + b,
 *   o' = o * (a / Z') + o_c * (b / Z')                 (scale, then axpy: the table's ops)
 * starting from o = o_0, M = m_0, Z = l_0. With np <= ATTEND_CHUNK that is the plain softmax-
 * weighted sum, the same calls in the same order. F16 cells: the chunk's rows are converted to float
 * once, into the scratch (fb), and read from there by one F32 matmul and one weighted sum. Q8_0 cells
 * (k_off and v_off multiples of 32): the scores as llama.cpp's over a q8_0 K cache, the queries
 * quantized to Q8_0 blocks (once per call) and the chunk's key blocks as stored, one Q8_0 matmul
 * (exact integer block sums, then the table's float chain; batch-invariant, so a head's bits still do
 * not depend on its group); the values converted to float for the weighted sum.
 */
#ifndef MOETAX_ATTN_ATTEND_H
#define MOETAX_ATTN_ATTEND_H

#include <stdbool.h>
#include <stdint.h>

#include "moetax/kernels.h"
#include "moetax/kvcache.h"

enum { ATTEND_CHUNK = 256 }; /* positions per chunk */

/* Where a head group's keys and values lie in one sequence's cache rows of one layer. */
struct attend_src {
    const struct moetax_kvcache *kv;
    int32_t layer;
    const int32_t *blk;   /* the sequence's block table (moetax_kvcache_seq_blocks) */
    enum moetax_type ct;  /* the cells' type: F32, F16 or Q8_0 (moetax_kvcache_type) */
    int64_t kvr;          /* values per cell row */
    int64_t k_off, k_cols; /* the keys: values k_off .. k_off + k_cols of each row */
    int64_t v_off, v_cols; /* the values: v_off .. v_off + v_cols */
};

/* A worker's scratch for up to nh heads (attend_scratch_floats). */
struct attend_scratch {
    float *sc; /* [nh][ATTEND_CHUNK] scores, then probabilities */
    float *oc; /* [nh][v_cols] a later chunk's weighted sum */
    float *ms; /* [nh][4] the chunk's max and divisor, the running ones */
    float *fb; /* F16 / Q8_0 cells: a chunk's keys and values (attend_cells_floats, nq >= nh); else NULL */
};

/* Floats of sc + oc + ms for nh heads of v_cols values. */
int64_t attend_scratch_floats(int64_t nh, int64_t v_cols);
/* Floats of fb for keys of k_cols and values of v_cols (F16 / Q8_0 cells), for calls of up to nq query
 * rows (attend_heads' nh, attend_tile's tokens x heads). */
int64_t attend_cells_floats(int64_t k_cols, int64_t v_cols, int64_t nq);
/* Lays sc, oc and ms out in buf (attend_scratch_floats(nh, v_cols) floats); fb as given. */
struct attend_scratch attend_scratch_at(float *buf, int64_t nh, int64_t v_cols, float *fb);

/* A cache row of n floats (row: ru32(n) floats where ct is Q8_0, the rest zero) into cell, in the
 * cells' type ct (F16 or Q8_0: ggml's quantize_row_q8_0). */
void attend_cell_write(const struct moetax_kernels *K, enum moetax_type ct, const float *row, int64_t n, void *cell);
/* Floats of a row buffer for attend_cell_write. */
static inline int64_t attend_cell_row_floats(int64_t n) { return (n + 31) / 32 * 32; }

/* Chunks of np positions. */
static inline int64_t attend_n_chunks(int64_t np) { return (np + ATTEND_CHUNK - 1) / ATTEND_CHUNK; }

/* Chunk c of positions 0 .. np-1 for heads q_h (h < nh): its softmax-weighted sum into o [nh][ldo]
 * and its max and divisor per head into ms[h * 2 + 0/1]. A head's results do not depend on nh
 * (2 or more) nor on the scratch, so chunks can be made apart (by different workers) and merged
 * later with attend_fold in order, with the bits of attend_heads. */
void attend_chunk(const struct moetax_kernels *K, const struct attend_src *src, const float *q, int64_t nh,
                  int64_t np, int64_t c, float kq_scale, float *o, int64_t ldo, float *ms,
                  const struct attend_scratch *w);
/* One head's merge of its next chunk (weighted sum oc of n values, max m, divisor l) into o, with
 * the running max and divisor run[0], run[1] (the merge above). */
void attend_fold(const struct moetax_kernels *K, float *o, const float *oc, int64_t n, float *run, float m, float l);

/* A tile of nt tokens of one sequence (a prompt's), token i over positions 0 .. np[i]-1 (np
 * ascending), each with nh >= 2 query heads (token i's head h at q + (i * nh + h) * k_cols), into
 * o (token i's head h at o + i * ldo_t + h * ldo): per chunk of positions the rows are read (F16
 * and Q8_0 cells: converted) once for all of the tile's tokens, the scores one matmul with the tokens' heads
 * as its batch, the weighted sums one chain for the tokens that see the whole chunk and one per
 * token for those that see part of it; per token and head the same calls on the same values as
 * attend_heads for its heads alone, so the same bits (the F32/F16 matmul's per-output chain is one
 * for every batch of 2+ rows up to rows of ATTEND_TILE_MAX_COLS; wsum's per row). */
enum { ATTEND_TILE_ROWS = 64, ATTEND_TILE_MAX_COLS = 1024 };
/* Tokens per tile for nh heads a token. */
static inline int64_t attend_tile_tokens(int64_t nh) { return nh >= ATTEND_TILE_ROWS ? 1 : ATTEND_TILE_ROWS / nh; }
/* A worker's scratch for a tile of up to nq = tokens x heads rows (attend_tile_floats). */
struct attend_tile_scratch {
    float *sc;  /* [nq][ATTEND_CHUNK] */
    float *oc;  /* [nq][v_cols] a later chunk's weighted sums */
    float *ot;  /* [nq][v_cols] the tile's outputs */
    float *ms;  /* [nq][2] a chunk's max and divisor */
    float *run; /* [nq][2] the running ones */
    float *fb;  /* F16 / Q8_0 cells: attend_cells_floats (nq >= the tile's rows); else NULL */
};
/* A micro-batch's tokens cut into tiles: runs of tokens of one sequence at consecutive positions,
 * in pieces of at most tq, tile k = tokens start[k] .. start[k+1]-1 (start: n + 1 entries);
 * returns the tiles. */
int64_t attend_tiles(const int32_t *seq, const int32_t *pos, int64_t n, int64_t tq, int64_t *start);
/* attend_tiles with the most tokens a tile of nh heads takes (attend_tile_tokens), halved while the
 * tiles times per_tile items are fewer than two per worker; returns the tiles, or 0 where they
 * would all be single tokens (attend_heads then). */
int64_t attend_tiles_for(const int32_t *seq, const int32_t *pos, int64_t n, int64_t nh, int64_t per_tile, int nth,
                         int64_t *start);
int64_t attend_tile_floats(int64_t nq, int64_t v_cols);
struct attend_tile_scratch attend_tile_at(float *buf, int64_t nq, int64_t v_cols, float *fb);
void attend_tile(const struct moetax_kernels *K, const struct attend_src *src, const float *q, int64_t nh,
                 const int64_t *np, int64_t nt, float kq_scale, float *o, int64_t ldo_t, int64_t ldo,
                 const struct attend_tile_scratch *w);

/* Chunks made apart (attend_chunk) for a micro-batch's tokens at positions pos[0 .. n): first[t]
 * (t <= n) the chunks before token t's, counted in token order; returns the most chunks of one
 * token. */
int64_t attend_chunks_first(const int32_t *pos, int64_t n, int64_t *first);
/* The split over chunks (mla.c, gqa.c) takes micro-batches of at most ATTEND_SPLIT_TOKENS tokens;
 * its items' buffers hold attend_split_cap of them: tokens of different sequences share the
 * cache's n_cells, so their chunks are at most the cells' plus a partial one per token (a
 * micro-batch that needs more, several tokens of one long sequence, is not split). */
enum { ATTEND_SPLIT_TOKENS = 8 };
static inline int64_t attend_split_cap(int64_t n_cells, int64_t n_ubatch) {
    return attend_n_chunks(n_cells) + (n_ubatch < ATTEND_SPLIT_TOKENS ? n_ubatch : ATTEND_SPLIT_TOKENS);
}
/* Head h of one token merged from its chunks' items i0 .. i1-1 (in order), item i's weighted sums
 * at oi + i * ldi (head h at + h * v_cols), its maxima and divisors at msi + i * 2 * nh_items (head
 * h at + 2 h), into o [v_cols]: attend_heads' merge, the same bits. */
void attend_merge(const struct moetax_kernels *K, const float *oi, int64_t ldi, const float *msi, int64_t nh_items,
                  int64_t i0, int64_t i1, int64_t h, int64_t v_cols, float *o);

/* o[h * ldo + c] (h < nh, c < v_cols) = sum_j softmax_j(kq_scale * q_h . K_j) V_j over the positions
 * j < np, q_h at q + h * k_cols; all chunks, merged as above. */
void attend_heads(const struct moetax_kernels *K, const struct attend_src *src, const float *q, int64_t nh,
                  int64_t np, float kq_scale, float *o, int64_t ldo, const struct attend_scratch *w);

#endif
