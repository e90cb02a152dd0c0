/*
 * moetax/kvcache.h - the KV cache: many sequences in one budget of cells, in
 * fixed-size blocks.
 *
 * DESIGN
 *   A cell holds one token's cached row for every layer (MLA: [kv_norm ;
 *   k_pe], kv_lora + rope floats per layer). The budget of n_cells cells is cut
 *   into blocks of block_size cells; a sequence owns a table of blocks, one
 *   per block_size positions, in position order (a paged cache, as vLLM's), so
 *   sequences of any lengths share the budget without copying and without
 *   fragmentation: every free block serves any sequence. Storage is one array
 *   per layer, [n_blocks * block_size][row], so a block's rows in a layer are
 *   contiguous and attention reads a sequence block by block.
 *
 *   Sequences hold positions 0 .. len-1 with no holes (attention over a
 *   sequence is causal over all its positions): tokens are appended at len,
 *   and removal cuts a sequence's tail (or all of it). Blocks carry reference
 *   counts: moetax_kvcache_seq_cp shares a prefix's blocks between two
 *   sequences, and the first write into a shared block copies it (copy on
 *   write), so a shared prompt is stored once.
 *
 *   The memory API follows llama.cpp's (llama_memory_seq_rm / seq_cp /
 *   seq_keep / clear); unlike llama.cpp's unified cache, removing positions in
 *   the middle of a sequence is refused (MOETAX_ERR_UNSUPPORTED): they would
 *   leave a hole that attention over the sequence cannot skip.
 *
 *   A batch is reserved before it runs (moetax_kvcache_reserve): every token's
 *   position must be the next of its sequence, and the blocks the batch needs
 *   (new ones, and copies of shared ones it writes into) must all be free, or
 *   nothing changes and the error says how many cells are missing; the
 *   sequences already in the cache are untouched. moetax_kvcache_commit then
 *   makes the written positions part of their sequences; moetax_kvcache_abort
 *   takes a failed batch back out (its sequences' lengths as before it).
 *
 * INVARIANTS
 *   - Every block is free or referenced by at least one sequence's table;
 *     free blocks + referenced blocks = n_blocks.
 *   - A block referenced by more than one table is never written.
 *   - Cells are F32, F16 or Q8_0 (type): F16 halves the cache, as llama.cpp's
 *     default; moetax then no longer matches llama.cpp's F32 cache to the bit.
 *     Q8_0 (llama.cpp's -ctk/-ctv q8_0) quarters it: each row in blocks of 32
 *     values (ggml's block_q8_0, the last block zero-padded), quantized as
 *     ggml's quantize_row_q8_0 when written; attention multiplies the keys'
 *     blocks with queries quantized to Q8_0 (integer block sums, as llama.cpp
 *     over a q8_0 K cache) and reads the values back as float (src/attn/attend.h).
 */
#ifndef MOETAX_KVCACHE_H
#define MOETAX_KVCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moetax/status.h"
#include "moetax/types.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { MOETAX_KV_BLOCK_DEFAULT = 32, MOETAX_KV_SEQ_MAX_DEFAULT = 64 };

struct moetax_kvcache_params {
    int64_t n_cells;    /* total token budget (rounded up to whole blocks) */
    int32_t block_size; /* cells per block; 0: MOETAX_KV_BLOCK_DEFAULT */
    int32_t n_seq_max;  /* sequence ids 0 .. n_seq_max-1; 0: MOETAX_KV_SEQ_MAX_DEFAULT */
    enum moetax_type type; /* MOETAX_TYPE_F32 (the default, 0), MOETAX_TYPE_F16 or MOETAX_TYPE_Q8_0 */
};

struct moetax_kvcache;

/* A cache of n_layer layers, row values per cell and layer. */
moetax_status moetax_kvcache_init(int32_t n_layer, int64_t row, const struct moetax_kvcache_params *p,
                                  struct moetax_kvcache **out);
void moetax_kvcache_free(struct moetax_kvcache *kv);

int64_t moetax_kvcache_n_cells(const struct moetax_kvcache *kv);
/* Cells of free blocks (what any sequence can still grow by, at least). */
int64_t moetax_kvcache_n_free(const struct moetax_kvcache *kv);
int32_t moetax_kvcache_block_size(const struct moetax_kvcache *kv);
int32_t moetax_kvcache_n_seq_max(const struct moetax_kvcache *kv);
enum moetax_type moetax_kvcache_type(const struct moetax_kvcache *kv);
size_t moetax_kvcache_bytes(const struct moetax_kvcache *kv);
/* Bytes of one cell's row in one layer (rows lie this far apart in a block). */
size_t moetax_kvcache_row_bytes(const struct moetax_kvcache *kv);
/* Positions a sequence holds (its next position); 0 for an empty or invalid id. */
int64_t moetax_kvcache_seq_len(const struct moetax_kvcache *kv, int32_t seq);

/* Remove positions [p0, p1) of sequence seq (seq < 0: of every sequence;
 * p0 < 0: 0; p1 < 0: to the end). Only a tail (p1 at or past the end) can go. */
moetax_status moetax_kvcache_seq_rm(struct moetax_kvcache *kv, int32_t seq, int64_t p0, int64_t p1);
/* Make dst hold positions [0, p1) of src (p1 < 0: all of src), sharing src's
 * blocks; whatever dst held is removed. p0 must be 0 or negative (a prefix). */
moetax_status moetax_kvcache_seq_cp(struct moetax_kvcache *kv, int32_t src, int32_t dst, int64_t p0, int64_t p1);
/* Remove every sequence but seq. */
void moetax_kvcache_seq_keep(struct moetax_kvcache *kv, int32_t seq);
/* Remove every sequence. */
void moetax_kvcache_clear(struct moetax_kvcache *kv);

/* Reserve cells for n tokens (seq[i], pos[i]): all or nothing (see DESIGN).
 * Copies shared blocks the batch writes into. MOETAX_ERR_ARG for a bad id or
 * a position that is not the next of its sequence, MOETAX_ERR_LIMIT when the
 * blocks do not fit. */
moetax_status moetax_kvcache_reserve(struct moetax_kvcache *kv, const int32_t *seq, const int32_t *pos, int64_t n);
/* After the reserved tokens were written: each sequence's length becomes one
 * past its highest position among them. */
void moetax_kvcache_commit(struct moetax_kvcache *kv, const int32_t *seq, const int32_t *pos, int64_t n);
/* After a reserved batch failed (some of it may have been committed): every
 * sequence back to its length before the reserve, the blocks reserved for it
 * released. Only before any other operation on the cache. */
void moetax_kvcache_abort(struct moetax_kvcache *kv);

/* The row of (seq, pos) in layer il (the position's block must be held): row
 * values of the cache's type (float, uint16_t F16 or moetax_block_q8_0s). */
void *moetax_kvcache_row(struct moetax_kvcache *kv, int32_t il, int32_t seq, int64_t pos);
/* Sequence seq's block table (*n_blocks entries). */
const int32_t *moetax_kvcache_seq_blocks(const struct moetax_kvcache *kv, int32_t seq, int32_t *n_blocks);
/* The first row of block b in layer il (block_size rows follow, row_bytes apart). */
const void *moetax_kvcache_block_rows(const struct moetax_kvcache *kv, int32_t il, int32_t b);
/* Blocks referenced by more than one sequence (shared prefixes). */
int32_t moetax_kvcache_n_shared_blocks(const struct moetax_kvcache *kv);

#ifdef __cplusplus
}
#endif
#endif
