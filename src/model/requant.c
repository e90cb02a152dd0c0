/* requant.c - routed experts re-quantized in memory at load (see requant.h). */
#include "model/requant.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "moetax/kernels.h"

/* One expert tensor to convert: its weight (and, fused, the up view that shares it). */
struct rq_item {
    struct moetax_weight *w, *up_view;
    int il;
    const char *what;                /* gate, up, gate_up, down */
    int64_t unit;                    /* repack unit in rows: a matrix, or half a fused gate_up */
    const uint8_t *src;              /* GGUF layout (the mapping or an aligned copy) */
    uint8_t *dst;
    size_t src_row, dst_row;
};

struct rq_job {
    const struct moetax_model *m;
    struct rq_item *items;
    int n_items;
    enum moetax_type to;
    int64_t max_cols;
    bool repack;
    _Atomic int64_t next;            /* matrices handed out: item-major, expert-minor */
    int64_t n_mat;
    _Atomic int err;                 /* a repack that ran out of memory, or a row that is not finite */
    _Atomic int64_t bad;             /* the first such row's matrix (k) * 2^32 + row, or -1 */
};


/* Matrix k of the job (item-major, expert-minor): its item, or -1 past the last, and the expert in it. */
static int rq_locate(const struct rq_job *j, int64_t k, int64_t *e) {
    *e = k;
    for (int i = 0; i < j->n_items; i++) {
        const int64_t E = j->items[i].w->ne[2] > 0 ? j->items[i].w->ne[2] : 1;
        if (*e < E) return i;
        *e -= E;
    }
    return -1;
}

static void *rq_worker(void *arg) {
    struct rq_job *j = arg;
    float *row = malloc(sizeof(float) * (size_t)j->max_cols);
    if (!row) { atomic_store(&j->err, MOETAX_ERR_NOMEM); return NULL; }
    const struct moetax_kernels *K = moetax_kernels_get();
    for (;;) {
        int64_t k = atomic_fetch_add(&j->next, 1);
        if (k >= j->n_mat) break;
        int64_t e;
        const int it = rq_locate(j, k, &e);
        if (it < 0) break;
        const struct rq_item *x = &j->items[it];
        const int64_t nc = x->w->ne[0], nr = x->w->ne[1];
        const uint8_t *s = x->src + (size_t)e * x->src_row * (size_t)nr;
        uint8_t *d = x->dst + (size_t)e * x->dst_row * (size_t)nr;
        for (int64_t r = 0; r < nr; r++) {
            moetax_to_float(x->w->type, s + (size_t)r * x->src_row, row, nc);
            if (moetax_nonfinite_at(row, nc) >= 0) { /* what a quantized type cannot hold: refused by the caller */
                int64_t none = -1;
                atomic_compare_exchange_strong(&j->bad, &none, k * ((int64_t)1 << 32) + r);
                atomic_store(&j->err, MOETAX_ERR_NUMERIC);
                memset(row, 0, sizeof(float) * (size_t)nc);
            }
            moetax_from_float(j->to, row, d + (size_t)r * x->dst_row, nc);
        }
        if (j->repack)
            for (int64_t r = 0; r < nr; r += x->unit)
                if (moetax_kernels_repack(K, j->to, d + (size_t)r * x->dst_row, d + (size_t)r * x->dst_row,
                                          nr - r < x->unit ? nr - r : x->unit, nc))
                    atomic_store(&j->err, MOETAX_ERR_NOMEM);
        /* the file's pages of this matrix go now, not after the last: the peak is about one copy of the experts */
        moetax_model_release_file_pages(j->m, s, x->src_row * (size_t)nr);
    }
    free(row);
    return NULL;
}

/* (requant.h) 4 KiB pages there first: a 2 MiB mapping of the file would bring the dropped
 * pages back whenever a neighbour in the same 2 MiB is touched (a router matrix, token_embd
 * rows), and count them in RSS once more (measured: `small` Q8_0 with an expert store, 59 MiB
 * of the mapping resident again). */
void moetax_model_release_file_pages(const struct moetax_model *m, const void *p, size_t n) {
    const struct moetax_gguf *g = m->gguf;
    long psz = sysconf(_SC_PAGESIZE);
    if (!g->mapped || psz <= 0 || (const uint8_t *)p < g->base || (const uint8_t *)p + n > g->base + g->size) return;
    uintptr_t a = ((uintptr_t)p + (uintptr_t)psz - 1) & ~(uintptr_t)(psz - 1);
    uintptr_t b = ((uintptr_t)p + n) & ~(uintptr_t)(psz - 1);
    if (b <= a) return;
#ifdef MADV_NOHUGEPAGE
    (void)madvise((void *)a, b - a, MADV_NOHUGEPAGE);
#endif
    (void)madvise((void *)a, b - a, MADV_DONTNEED);
}

static bool target_ok(enum moetax_type t) {
    switch (t) {
    case MOETAX_TYPE_F16: case MOETAX_TYPE_BF16: case MOETAX_TYPE_Q8_0: case MOETAX_TYPE_Q4_0: case MOETAX_TYPE_Q5_0:
    case MOETAX_TYPE_Q4_1: case MOETAX_TYPE_Q5_1:
    case MOETAX_TYPE_Q2_K: case MOETAX_TYPE_Q3_K: case MOETAX_TYPE_Q4_K: case MOETAX_TYPE_Q5_K:
    case MOETAX_TYPE_Q6_K: return true;
    default: return false;
    }
}

moetax_status model_requant_experts(struct moetax_model *m, enum moetax_type to, struct moetax_huge_buf *buf) {
    const struct moetax_hparams *hp = &m->hp;
    if (!target_ok(to))
        return moetax_error(MOETAX_ERR_ARG, "expert type %s: routed experts can be re-quantized to f16, bf16, q8_0, "
                            "q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k or q6_k", moetax_type_name(to));
    if (hp->n_expert <= 0) return moetax_error(MOETAX_ERR_ARG, "%s has no routed experts to re-quantize", m->gguf->path);
    struct rq_item *items = calloc((size_t)(3 * hp->n_layer + 1), sizeof *items);
    if (!items) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    int n = 0;
    int64_t max_cols = 1, n_mat = 0;
    size_t total = 0;
    moetax_status st = MOETAX_OK;
    for (int il = 0; !st && il < hp->n_layer; il++) {
        struct moetax_layer *l = &m->layers[il];
        if (!l->is_moe) continue;
        struct moetax_weight *ws[3] = {&l->gate_exps, l->fused_gate_up ? NULL : &l->up_exps, &l->down_exps};
        const char *names[3] = {l->fused_gate_up ? "gate_up" : "gate", "up", "down"};
        for (int i = 0; !st && i < 3; i++) {
            struct moetax_weight *w = ws[i];
            if (!w || !w->data || w->type == to) continue;
            if (w->ne[0] % moetax_type_blck_size(to)) {
                st = moetax_error(MOETAX_ERR_SHAPE, "%s: tensor 'blk.%d.ffn_%s_exps.weight' has rows of %lld values, "
                                  "not a multiple of %s's block of %lld: its experts cannot be re-quantized to %s",
                                  m->gguf->path, il, names[i], (long long)w->ne[0], moetax_type_name(to),
                                  (long long)moetax_type_blck_size(to), moetax_type_name(to));
                break;
            }
            struct rq_item *x = &items[n++];
            x->w = w;
            x->up_view = i == 0 && l->fused_gate_up ? &l->up_exps : NULL;
            x->il = il;
            x->what = names[i];
            x->unit = i == 0 && l->fused_gate_up ? hp->n_ff_exp : w->ne[1];
            x->src = w->data;
            x->src_row = w->row_bytes;
            x->dst_row = moetax_row_size(to, w->ne[0]);
            const int64_t E = w->ne[2] > 0 ? w->ne[2] : 1;
            total += (x->dst_row * (size_t)w->ne[1] * (size_t)E + 63) / 64 * 64;
            n_mat += E;
            if (w->ne[0] > max_cols) max_cols = w->ne[0];
        }
    }
    if (st || !n) { free(items); return st; } /* nothing to convert: every expert is of the target type already */
    uint8_t *base = moetax_huge_alloc(total, buf);
    if (!base) {
        free(items);
        return moetax_error(MOETAX_ERR_NOMEM, "%s: cannot allocate %.1f MiB for the routed experts as %s",
                            m->gguf->path, (double)total / 1048576.0, moetax_type_name(to));
    }
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        items[i].dst = base + off;
        const int64_t E = items[i].w->ne[2] > 0 ? items[i].w->ne[2] : 1;
        off += (items[i].dst_row * (size_t)items[i].w->ne[1] * (size_t)E + 63) / 64 * 64;
    }
    const struct moetax_kernels *K = moetax_kernels_get();
    struct rq_job job = {.m = m, .items = items, .n_items = n, .to = to, .max_cols = max_cols,
                         .repack = K->weights_repacked && K->weights_repacked(to), .n_mat = n_mat};
    atomic_init(&job.next, 0);
    atomic_init(&job.err, 0);
    atomic_init(&job.bad, -1);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int nt = ncpu < 1 ? 1 : ncpu > 16 ? 16 : (int)ncpu;
    pthread_t th[16];
    int started = 0;
    for (int t = 1; t < nt; t++)
        if (!pthread_create(&th[started], NULL, rq_worker, &job)) started++;
    rq_worker(&job); /* the caller is worker 0 */
    for (int t = 0; t < started; t++) pthread_join(th[t], NULL);
    if (atomic_load(&job.err)) {
        const int64_t bad = atomic_load(&job.bad);
        if (bad >= 0) {
            int64_t e;
            const int it = rq_locate(&job, bad >> 32, &e);
            st = moetax_error(MOETAX_ERR_NUMERIC, "%s: layer %d, expert %lld's %s, row %lld holds a NaN or an infinity: "
                              "--expert-type %s cannot hold it (the file's weights are damaged)", m->gguf->path,
                              it >= 0 ? items[it].il : -1, (long long)e, it >= 0 ? items[it].what : "?",
                              (long long)(bad & 0xffffffff), moetax_type_name(to));
        } else {
            st = moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory re-quantizing the routed experts", m->gguf->path);
        }
        moetax_huge_free(buf);
        free(items);
        return st;
    }
    for (int i = 0; i < n; i++) {
        struct rq_item *x = &items[i];
        struct moetax_weight *w = x->w;
        const int64_t E = w->ne[2] > 0 ? w->ne[2] : 1;
        if (w->file_data) /* the pages that straddle two matrices */
            moetax_model_release_file_pages(m, w->file_data, x->src_row * (size_t)w->ne[1] * (size_t)E);
        w->data = x->dst;
        w->file_data = NULL;
        w->type = to;
        w->row_bytes = x->dst_row;
        w->mat_bytes = x->dst_row * (size_t)w->ne[1];
        if (x->up_view) { /* up = rows F..2F-1 of each fused matrix */
            *x->up_view = *w;
            x->up_view->data = (const uint8_t *)w->data + (size_t)hp->n_ff_exp * w->row_bytes;
        }
    }
    if (moetax_act_is_q8_0(to)) m->has_q8_0 = true;
    if (moetax_act_is_q4_0(to)) m->has_q4_0 = true;
    if (moetax_type_is_kquant(to)) m->has_kq = true;
    free(items);
    return MOETAX_OK;
}

bool model_experts_requantized(const struct moetax_model *m) {
    for (int il = 0; il < m->hp.n_layer; il++) {
        const struct moetax_layer *l = &m->layers[il];
        if (l->is_moe && ((l->gate_exps.data && !l->gate_exps.file_data) || (l->down_exps.data && !l->down_exps.file_data)))
            return true;
    }
    return false;
}
