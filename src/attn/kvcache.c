/*
 * kvcache.c - the paged KV cache: blocks of cells with reference counts, one
 * block table per sequence (see moetax/kvcache.h).
 */
#include <stdlib.h>
#include <string.h>

#include "moetax/kvcache.h"

struct kv_seq {
    int32_t *table; /* [n_blocks] block of each block_size positions */
    int32_t nb;     /* blocks in the table: ceil(len / block_size) */
    int64_t len;    /* positions held */
};

struct moetax_kvcache {
    int32_t n_layer, bs, n_seq;
    int64_t row, n_blocks;
    enum moetax_type type;
    size_t rb;          /* bytes per row: row values (Q8_0: in blocks of 32, the last padded) */
    char *data;         /* [n_layer][n_blocks * bs] rows */
    int32_t *ref;       /* [n_blocks] tables referencing each block */
    int32_t *free_list; /* [n_blocks] stack of free blocks */
    int64_t n_free;
    struct kv_seq *seqs;   /* [n_seq] */
    int64_t *scratch_len;  /* [n_seq] reserve's running lengths */
    int64_t *undo_len;     /* [n_seq] each sequence's length before the last reserve (moetax_kvcache_abort) */
    int32_t *scratch_w;    /* [n_blocks] reserve's writers per shared block (zero outside reserve) */
};

moetax_status moetax_kvcache_init(int32_t n_layer, int64_t row, const struct moetax_kvcache_params *p,
                                  struct moetax_kvcache **out) {
    *out = NULL;
    const int32_t bs = p && p->block_size > 0 ? p->block_size : MOETAX_KV_BLOCK_DEFAULT;
    const int32_t ns = p && p->n_seq_max > 0 ? p->n_seq_max : MOETAX_KV_SEQ_MAX_DEFAULT;
    const int64_t cells = p ? p->n_cells : 0;
    if (n_layer <= 0 || row <= 0 || cells <= 0)
        return moetax_error(MOETAX_ERR_ARG, "KV cache: %d layers, %lld values per row, %lld cells: each must be > 0",
                            n_layer, (long long)row, (long long)cells);
    if (bs > (1 << 16) || ns > (1 << 16))
        return moetax_error(MOETAX_ERR_ARG, "KV cache: block size %d or sequence count %d above %d", bs, ns, 1 << 16);
    const enum moetax_type type = p ? p->type : MOETAX_TYPE_F32;
    if (type != MOETAX_TYPE_F32 && type != MOETAX_TYPE_F16 && type != MOETAX_TYPE_Q8_0)
        return moetax_error(MOETAX_ERR_UNSUPPORTED, "KV cache cells of type %s: only f32, f16 and q8_0",
                            moetax_type_name(type));
    if (cells > (int64_t)(1 << 24) * bs) /* before rounding up to whole blocks, which could overflow */
        return moetax_error(MOETAX_ERR_ARG, "KV cache: %lld cells is too large (at most %lld)", (long long)cells,
                            (long long)(1 << 24) * bs);
    const double rb = type == MOETAX_TYPE_Q8_0 ? (double)((row + 31) / 32) * (double)sizeof(moetax_block_q8_0)
                                                : (double)row * (type == MOETAX_TYPE_F16 ? 2 : 4);
    const int64_t nblk = (cells + bs - 1) / bs;
    const double bytes = (double)n_layer * (double)nblk * bs * rb;
    if (nblk > (1 << 24) || bytes > (double)SIZE_MAX / 2)
        return moetax_error(MOETAX_ERR_ARG, "KV cache: %lld cells (%.1f GiB) is too large", (long long)cells,
                            bytes / (1 << 30));
    struct moetax_kvcache *kv = calloc(1, sizeof *kv);
    if (!kv) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    kv->n_layer = n_layer;
    kv->bs = bs;
    kv->n_seq = ns;
    kv->row = row;
    kv->type = type;
    kv->rb = (size_t)rb;
    kv->n_blocks = nblk;
    kv->data = malloc((size_t)bytes);
    kv->ref = calloc((size_t)nblk, sizeof(int32_t));
    kv->free_list = malloc(sizeof(int32_t) * (size_t)nblk);
    kv->seqs = calloc((size_t)ns, sizeof *kv->seqs);
    kv->scratch_len = calloc((size_t)ns, sizeof(int64_t));
    kv->undo_len = calloc((size_t)ns, sizeof(int64_t));
    kv->scratch_w = calloc((size_t)nblk, sizeof(int32_t));
    bool ok = kv->data && kv->ref && kv->free_list && kv->seqs && kv->scratch_len && kv->undo_len && kv->scratch_w;
    for (int32_t s = 0; ok && s < ns; s++) ok = (kv->seqs[s].table = malloc(sizeof(int32_t) * (size_t)nblk)) != NULL;
    if (!ok) {
        moetax_kvcache_free(kv);
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory for a KV cache of %.1f MiB (%lld cells); lower --ctx",
                            bytes / (1 << 20), (long long)cells);
    }
    moetax_kvcache_clear(kv);
    *out = kv;
    return MOETAX_OK;
}

void moetax_kvcache_free(struct moetax_kvcache *kv) {
    if (!kv) return;
    if (kv->seqs)
        for (int32_t s = 0; s < kv->n_seq; s++) free(kv->seqs[s].table);
    free(kv->seqs);
    free(kv->data);
    free(kv->ref);
    free(kv->free_list);
    free(kv->scratch_len);
    free(kv->undo_len);
    free(kv->scratch_w);
    free(kv);
}

int64_t moetax_kvcache_n_cells(const struct moetax_kvcache *kv) { return kv->n_blocks * kv->bs; }
int64_t moetax_kvcache_n_free(const struct moetax_kvcache *kv) { return kv->n_free * kv->bs; }
int32_t moetax_kvcache_block_size(const struct moetax_kvcache *kv) { return kv->bs; }
int32_t moetax_kvcache_n_seq_max(const struct moetax_kvcache *kv) { return kv->n_seq; }
enum moetax_type moetax_kvcache_type(const struct moetax_kvcache *kv) { return kv->type; }
size_t moetax_kvcache_bytes(const struct moetax_kvcache *kv) {
    return (size_t)kv->n_layer * (size_t)kv->n_blocks * (size_t)kv->bs * kv->rb;
}
size_t moetax_kvcache_row_bytes(const struct moetax_kvcache *kv) { return kv->rb; }
int64_t moetax_kvcache_seq_len(const struct moetax_kvcache *kv, int32_t seq) {
    return seq >= 0 && seq < kv->n_seq ? kv->seqs[seq].len : 0;
}

static int32_t block_alloc(struct moetax_kvcache *kv) {
    MOETAX_ASSERT(kv->n_free > 0);
    int32_t b = kv->free_list[--kv->n_free];
    kv->ref[b] = 1;
    return b;
}

static void block_unref(struct moetax_kvcache *kv, int32_t b) {
    MOETAX_ASSERT(kv->ref[b] > 0);
    if (--kv->ref[b] == 0) kv->free_list[kv->n_free++] = b;
}

/* Cut sequence s to its first len positions, releasing the blocks it no longer needs. */
static void seq_truncate(struct moetax_kvcache *kv, struct kv_seq *s, int64_t len) {
    if (len >= s->len && s->nb == (s->len + kv->bs - 1) / kv->bs) return;
    if (len > s->len) len = s->len;
    const int32_t keep = (int32_t)((len + kv->bs - 1) / kv->bs);
    for (int32_t i = keep; i < s->nb; i++) block_unref(kv, s->table[i]);
    s->nb = keep;
    s->len = len;
}

void moetax_kvcache_clear(struct moetax_kvcache *kv) {
    for (int32_t s = 0; s < kv->n_seq; s++) kv->seqs[s].nb = 0, kv->seqs[s].len = 0;
    kv->n_free = kv->n_blocks;
    for (int64_t b = 0; b < kv->n_blocks; b++) {
        kv->ref[b] = 0;
        kv->free_list[b] = (int32_t)(kv->n_blocks - 1 - b); /* block 0 is handed out first */
    }
}

static moetax_status check_seq(const struct moetax_kvcache *kv, int32_t seq, const char *what) {
    if (seq < 0 || seq >= kv->n_seq)
        return moetax_error(MOETAX_ERR_ARG, "KV cache: %s sequence id %d is outside 0..%d", what, seq, kv->n_seq - 1);
    return MOETAX_OK;
}

moetax_status moetax_kvcache_seq_rm(struct moetax_kvcache *kv, int32_t seq, int64_t p0, int64_t p1) {
    if (seq >= kv->n_seq) return check_seq(kv, seq, "removal:");
    if (p0 < 0) p0 = 0;
    if (p1 >= 0 && p1 <= p0) return MOETAX_OK; /* an empty range removes nothing */
    for (int32_t s = seq < 0 ? 0 : seq; s < (seq < 0 ? kv->n_seq : seq + 1); s++) {
        struct kv_seq *q = &kv->seqs[s];
        if (p0 >= q->len) continue;
        if (p1 >= 0 && p1 < q->len)
            return moetax_error(MOETAX_ERR_UNSUPPORTED,
                                "KV cache: sequence %d holds positions 0..%lld; removing %lld..%lld would leave a "
                                "hole (only a tail can be removed: p1 = -1)",
                                s, (long long)q->len - 1, (long long)p0, (long long)p1 - 1);
    }
    for (int32_t s = seq < 0 ? 0 : seq; s < (seq < 0 ? kv->n_seq : seq + 1); s++) seq_truncate(kv, &kv->seqs[s], p0);
    return MOETAX_OK;
}

moetax_status moetax_kvcache_seq_cp(struct moetax_kvcache *kv, int32_t src, int32_t dst, int64_t p0, int64_t p1) {
    moetax_status st;
    if ((st = check_seq(kv, src, "copy: source")) || (st = check_seq(kv, dst, "copy: destination"))) return st;
    if (p0 > 0)
        return moetax_error(MOETAX_ERR_UNSUPPORTED,
                            "KV cache: only a prefix can be copied (positions 0..p1), not from position %lld",
                            (long long)p0);
    if (src == dst) return MOETAX_OK;
    struct kv_seq *s = &kv->seqs[src], *d = &kv->seqs[dst];
    seq_truncate(kv, d, 0);
    const int64_t len = p1 < 0 || p1 > s->len ? s->len : p1;
    d->nb = (int32_t)((len + kv->bs - 1) / kv->bs);
    for (int32_t i = 0; i < d->nb; i++) {
        d->table[i] = s->table[i];
        kv->ref[d->table[i]]++;
    }
    d->len = len;
    return MOETAX_OK;
}

void moetax_kvcache_seq_keep(struct moetax_kvcache *kv, int32_t seq) {
    for (int32_t s = 0; s < kv->n_seq; s++)
        if (s != seq) seq_truncate(kv, &kv->seqs[s], 0);
}

moetax_status moetax_kvcache_reserve(struct moetax_kvcache *kv, const int32_t *seq, const int32_t *pos, int64_t n) {
    int64_t *len = kv->scratch_len;
    for (int32_t s = 0; s < kv->n_seq; s++) len[s] = kv->seqs[s].len;
    for (int64_t i = 0; i < n; i++) {
        moetax_status st = check_seq(kv, seq[i], "batch token's");
        if (st) return moetax_error(st, "batch token %lld: %s", (long long)i, moetax_last_error());
        if (pos[i] != len[seq[i]])
            return moetax_error(MOETAX_ERR_ARG,
                                "batch token %lld: position %d of sequence %d, but the sequence's next position is "
                                "%lld (a sequence's positions run 0, 1, 2, ... with no gaps)",
                                (long long)i, pos[i], seq[i], (long long)len[seq[i]]);
        len[seq[i]]++;
    }
    /* blocks needed: new ones past each table's end, and copies of shared last blocks that
     * the batch writes into: of w writers into a block r tables share, min(w, r - 1) copy
     * it (when all r write, the last one keeps it) */
    /* (a table may hold blocks past its length, from a batch that failed and was not aborted:
     * the block written next is the one of position len, not the table's last) */
    int64_t need = 0;
    for (int32_t s = 0; s < kv->n_seq; s++) {
        const struct kv_seq *q = &kv->seqs[s];
        if (len[s] == q->len) continue;
        const int64_t want = (len[s] + kv->bs - 1) / kv->bs;
        if (want > q->nb) need += want - q->nb;
        if (q->len % kv->bs) {
            const int32_t b = q->table[(q->len - 1) / kv->bs];
            if (kv->ref[b] > 1 && kv->scratch_w[b]++ < kv->ref[b] - 1) need++;
        }
    }
    for (int32_t s = 0; s < kv->n_seq; s++) {
        const struct kv_seq *q = &kv->seqs[s];
        if (len[s] != q->len && q->len % kv->bs) kv->scratch_w[q->table[(q->len - 1) / kv->bs]] = 0;
    }
    if (need > kv->n_free) {
        int64_t tokens = 0;
        for (int32_t s = 0; s < kv->n_seq; s++) tokens += len[s] - kv->seqs[s].len;
        return moetax_error(MOETAX_ERR_LIMIT,
                            "KV cache full: %lld more tokens need %lld blocks of %d cells, %lld of %lld blocks are "
                            "free (%lld cells in all); raise --ctx, or remove sequences",
                            (long long)tokens, (long long)need, kv->bs, (long long)kv->n_free,
                            (long long)kv->n_blocks, (long long)(kv->n_blocks * kv->bs));
    }
    for (int32_t s = 0; s < kv->n_seq; s++) kv->undo_len[s] = kv->seqs[s].len;
    for (int32_t s = 0; s < kv->n_seq; s++) {
        struct kv_seq *q = &kv->seqs[s];
        if (len[s] == q->len) continue;
        const int32_t last = (int32_t)((q->len - 1) / kv->bs);
        if (q->len % kv->bs && kv->ref[q->table[last]] > 1) { /* copy on write */
            const int32_t old = q->table[last], nb = block_alloc(kv);
            const size_t rows = (size_t)(q->len % kv->bs), rb = kv->rb;
            for (int32_t il = 0; il < kv->n_layer; il++)
                memcpy(kv->data + (size_t)(((int64_t)il * kv->n_blocks + nb) * kv->bs) * rb,
                       kv->data + (size_t)(((int64_t)il * kv->n_blocks + old) * kv->bs) * rb, rows * rb);
            block_unref(kv, old);
            q->table[last] = nb;
        }
        while (q->nb < (len[s] + kv->bs - 1) / kv->bs) q->table[q->nb++] = block_alloc(kv);
    }
    return MOETAX_OK;
}

void moetax_kvcache_abort(struct moetax_kvcache *kv) {
    for (int32_t s = 0; s < kv->n_seq; s++) seq_truncate(kv, &kv->seqs[s], kv->undo_len[s]);
}

void moetax_kvcache_commit(struct moetax_kvcache *kv, const int32_t *seq, const int32_t *pos, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (pos[i] + 1 > kv->seqs[seq[i]].len) kv->seqs[seq[i]].len = pos[i] + 1;
}

void *moetax_kvcache_row(struct moetax_kvcache *kv, int32_t il, int32_t seq, int64_t pos) {
    const struct kv_seq *q = &kv->seqs[seq];
    const int32_t b = q->table[pos / kv->bs];
    return kv->data + (size_t)(((int64_t)il * kv->n_blocks + b) * kv->bs + pos % kv->bs) * kv->rb;
}

const int32_t *moetax_kvcache_seq_blocks(const struct moetax_kvcache *kv, int32_t seq, int32_t *n_blocks) {
    *n_blocks = kv->seqs[seq].nb;
    return kv->seqs[seq].table;
}

const void *moetax_kvcache_block_rows(const struct moetax_kvcache *kv, int32_t il, int32_t b) {
    return kv->data + (size_t)(((int64_t)il * kv->n_blocks + b) * kv->bs) * kv->rb;
}

int32_t moetax_kvcache_n_shared_blocks(const struct moetax_kvcache *kv) {
    int32_t n = 0;
    for (int64_t b = 0; b < kv->n_blocks; b++) n += kv->ref[b] > 1;
    return n;
}
