/*
 * model.c - load a model: the GGUF file mapped, the architecture chosen from
 * general.architecture (src/model/arch.h: one file per architecture binds its
 * hyper-parameters and layer tensors), the shared tensor binding (every tensor
 * checked against the shape the metadata implies, weights used in place), the
 * repacked copies, prefaulting and the expert store's registration.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/mman.h>
#include <unistd.h>

#include "moetax/kernels.h"
#include "moetax/membw.h"
#include "moetax/model.h"
#ifdef MOETAX_WITH_MPI
#include "dist/dist.h"
#endif
#include "moetax/store.h"
#include "model/arch.h"
#include "model/requant.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

bool moetax_tensor_is_routed_expert(const struct moetax_gguf_tensor *t) {
    for (uint64_t i = 0; i + 6 <= t->name.len; i++)
        if (!memcmp(t->name.data + i, "_exps.", 6)) return true;
    return false;
}

/* Weights of a type the kernel table reads repacked (kernels.h, WEIGHT
 * LAYOUTS) are matmul'ed from a private copy in that layout, never from the
 * mapping; the token embedding (read by rows with moetax_to_float) is the
 * exception and stays mapped. */
static bool kernels_repack(enum moetax_type t) {
    const struct moetax_kernels *K = moetax_kernels_get();
    return K->weights_repacked && K->weights_repacked(t);
}

static bool model_copies(const struct moetax_model *m);

static bool tensor_read_repacked(const struct moetax_model *m, const struct moetax_gguf_tensor *t) {
    return (kernels_repack(t->type) || (model_copies(m) && t->n_dims >= 2)) &&
           !(t->name.len == 17 && !memcmp(t->name.data, "token_embd.weight", 17));
}

/* Fault tensors in now (page tables and, if needed, reads) when they fit
 * comfortably in RAM, so first-touch faults are paid at load and not in the
 * first decode steps: the resident part at load, the routed experts when a
 * context runs without an expert store (with one, they are never mapped in).
 * Tensors read through a repacked copy are skipped (the copy reads them once).
 * Best effort: older kernels lack MADV_POPULATE_READ. */
static const uint8_t *expert_mask(const struct moetax_model *m, int il);
static int tensor_layer(const struct moetax_gguf_tensor *t);

void moetax_model_prefault(const struct moetax_model *m, bool routed_experts) {
    const struct moetax_gguf *g = m->gguf;
    if (!g->mapped || (routed_experts && model_experts_requantized(m))) return; /* read from their converted copy */
    long pages = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || psz <= 0) return;
    uint64_t total = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (moetax_tensor_is_routed_expert(&g->tensors[i]) == routed_experts && !tensor_read_repacked(m, &g->tensors[i]))
            total += g->tensors[i].nbytes;
    if ((double)total > 0.5 * (double)pages * (double)psz) return;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const struct moetax_gguf_tensor *t = &g->tensors[i];
        if (moetax_tensor_is_routed_expert(t) != routed_experts || !t->nbytes || tensor_read_repacked(m, t)) continue;
        uintptr_t lo = (uintptr_t)t->data, hi = (uintptr_t)t->data + t->nbytes;
        const uint8_t *own = routed_experts && t->ne[2] > 0 ? expert_mask(m, tensor_layer(t)) : NULL;
        if (own) { /* this process's experts only */
            const uint64_t per = t->nbytes / (uint64_t)t->ne[2];
            for (int64_t e = 0; e < t->ne[2]; e++) {
                if (!own[e]) continue;
                uintptr_t a = (lo + per * (uint64_t)e) & ~(uintptr_t)(psz - 1);
                (void)madvise((void *)a, lo + per * (uint64_t)(e + 1) - a, MADV_POPULATE_READ);
            }
            continue;
        }
        uintptr_t a = lo & ~(uintptr_t)(psz - 1);
        (void)madvise((void *)a, hi - a, MADV_POPULATE_READ);
    }
}

struct owned {
    void **ptr;
    size_t n, cap;
    /* repacked copies (kernels.h, WEIGHT LAYOUTS): resident weights (at load)
     * and routed experts (moetax_model_prepare_experts), each one anonymous
     * mapping; munmap'ed by moetax_model_free */
    struct moetax_huge_buf rep_res, rep_exp;
    struct moetax_huge_buf requant; /* routed experts re-quantized at load (requant.h) */
    pthread_mutex_t mu; /* guards the one-time expert preparation */
    bool experts_prepared;
    bool copy_all; /* no_mmap: every weight the kernels read gets a private copy */
    /* [n_layer, n_expert]: 1 for the routed experts this process reads (expert parallelism:
     * moetax_model_set_expert_owned); NULL: all of them */
    uint8_t *exp_own;
};

static const uint8_t *expert_mask(const struct moetax_model *m, int il) {
    const struct owned *o = m->owned;
    if (!o || !o->exp_own || il < 0 || il >= m->hp.n_layer) return NULL;
    return o->exp_own + (size_t)il * (size_t)m->hp.n_expert;
}

/* N of a "blk.N." tensor name; -1 otherwise */
static int tensor_layer(const struct moetax_gguf_tensor *t) {
    char name[24] = {0};
    memcpy(name, t->name.data, t->name.len < sizeof name - 1 ? t->name.len : sizeof name - 1);
    int il = -1;
    return sscanf(name, "blk.%d.", &il) == 1 ? il : -1;
}

static bool model_copies(const struct moetax_model *m) { return m->owned && ((struct owned *)m->owned)->copy_all; }

void *arch_own(struct moetax_model *m, size_t bytes) {
    struct owned *o = m->owned;
    if (o->n == o->cap) {
        size_t cap = o->cap ? 2 * o->cap : 64;
        void **p = realloc(o->ptr, cap * sizeof *p);
        if (!p) return NULL;
        o->ptr = p;
        o->cap = cap;
    }
    void *p = calloc(1, bytes ? bytes : 1);
    if (p) o->ptr[o->n++] = p;
    return p;
}

/* ---- repacked copies ------------------------------------------------------------ */

/* Extra memory: each repacked weight takes as many bytes as in the file, in an
 * anonymous mapping (moetax_huge_alloc), so the resident Q4_0/Q8_0 weights (and,
 * without an expert store, the routed experts of those types) count once more in RSS;
 * the file pages they came from are released right after the copy (page cache
 * only, reclaimable), so the process does not hold both. */

/* Drop the pages of the (read-only, private) file mapping that lie wholly in
 * [p, p + n): they are read from a copy from now on, and would come back from
 * the file if touched again. */

static size_t weight_bytes(const struct moetax_weight *w) {
    return w->mat_bytes * (size_t)(w->ne[2] > 1 ? w->ne[2] : 1);
}

/* read through a private copy: repacked, or copied as is (no_mmap) */
static bool weight_repacked(const struct moetax_model *m, const struct moetax_weight *w) {
    return w->data && w->file_data && (kernels_repack(w->type) || model_copies(m));
}

/* Repack rows rows of w from src to dst (may be src), in units of `unit` rows
 * (kernels.h, WEIGHT LAYOUTS): a matrix, w->ne[1] rows, or half of a fused
 * gate_up matrix, n_ff_exp rows (its gate rows, then its up rows). */
static moetax_status repack_units(const struct moetax_weight *w, int64_t unit, void *dst, const void *src,
                                  int64_t rows) {
    const struct moetax_kernels *K = moetax_kernels_get();
    moetax_status st = MOETAX_OK;
    if (!kernels_repack(w->type)) { /* a plain copy (no_mmap) */
        if (dst != src) memcpy(dst, src, (size_t)rows * w->row_bytes);
        return st;
    }
    for (int64_t r = 0; !st && r < rows; r += unit)
        st = moetax_kernels_repack(K, w->type, (uint8_t *)dst + (size_t)r * w->row_bytes,
                                   (const uint8_t *)src + (size_t)r * w->row_bytes, rows - r < unit ? rows - r : unit,
                                   w->ne[0]);
    return st;
}

/* Copy ws[0..n) (file tensors the kernels read repacked; with no_mmap, all) into one anonymous
 * mapping, repacked in units of units[i] rows (units NULL: each matrix, ne[1]
 * rows), each 64-byte aligned, and point their data at it. */
static moetax_status repack_weights(const struct moetax_model *m, struct moetax_weight *const *ws,
                                    const int64_t *units, int n, struct moetax_huge_buf *out, const char *what,
                                    const uint8_t *const *owns) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += (weight_bytes(ws[i]) + 63) / 64 * 64;
    if (!total) return MOETAX_OK;
    uint8_t *buf = moetax_huge_alloc(total, out);
    if (!buf)
        return moetax_error(MOETAX_ERR_NOMEM, "%s: cannot allocate %.1f MiB for the %s %s%s",
                            m->gguf->path, (double)total / 1048576.0, what,
                            model_copies(m) ? "as private copies (--no-mmap)" : "in the kernels' layout",
                            strcmp(what, "routed experts") ? "" : " (an expert store needs less: --expert-budget)");
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        struct moetax_weight *w = ws[i];
        const size_t nb = weight_bytes(w);
        /* not in place: cannot fail; from w->data: the mapping, or an aligned copy of it (bind).
         * With an owned set of experts only their matrices: the rest of the copy is never
         * touched, so it takes no memory */
        const uint8_t *own = owns ? owns[i] : NULL;
        for (int64_t e = 0; e < (own ? w->ne[2] : 1); e++) {
            if (own && !own[e]) continue;
            const size_t c0 = own ? w->mat_bytes * (size_t)e : 0, c1 = own ? c0 + w->mat_bytes : nb;
            (void)repack_units(w, units ? units[i] : w->ne[1], buf + off + c0, (const uint8_t *)w->data + c0,
                               (int64_t)((c1 - c0) / w->row_bytes));
        }
        w->data = buf + off;
        if (w->file_data != m->tok_embd.file_data) moetax_model_release_file_pages(m, w->file_data, nb); /* still read by rows */
        off += (nb + 63) / 64 * 64;
    }
    return MOETAX_OK;
}

/* At load: every resident weight the kernels read repacked (a tied output
 * matrix too: token_embd itself stays as stored). */
static moetax_status repack_resident(struct moetax_model *m) {
    struct owned *o = m->owned;
    const int per_layer = 16;
    struct moetax_weight **ws = malloc(sizeof *ws * (size_t)(1 + per_layer * m->hp.n_layer));
    if (!ws) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    int n = 0;
    if (weight_repacked(m, &m->output)) ws[n++] = &m->output;
    for (int il = 0; il < m->hp.n_layer; il++) {
        struct moetax_layer *l = &m->layers[il];
        struct moetax_weight *lw[] = {&l->wq, &l->wq_a, &l->wq_b, &l->wkv_a, &l->wk_b, &l->wv_b, &l->wo,
                                      &l->ffn_gate, &l->ffn_up, &l->ffn_down, &l->gate_inp, &l->gate_sh,
                                      &l->up_sh, &l->down_sh, &l->wk, &l->wv};
        _Static_assert(sizeof lw / sizeof lw[0] == 16, "per_layer");
        for (int i = 0; i < per_layer; i++)
            if (weight_repacked(m, lw[i])) ws[n++] = lw[i];
    }
    moetax_status st = repack_weights(m, ws, NULL, n, &o->rep_res, "resident weights", NULL);
    free(ws);
    return st;
}

moetax_status moetax_model_prepare_experts(const struct moetax_model *m) {
    struct owned *o = m->owned;
    moetax_status st = MOETAX_OK;
    pthread_mutex_lock(&o->mu);
    if (!o->experts_prepared) {
        struct moetax_weight **ws = malloc(sizeof *ws * (size_t)(3 * m->hp.n_layer + 1));
        int64_t *units = malloc(sizeof *units * (size_t)(3 * m->hp.n_layer + 1));
        const uint8_t **owns = malloc(sizeof *owns * (size_t)(3 * m->hp.n_layer + 1));
        int n = 0;
        if (!ws || !units || !owns) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
        for (int il = 0; !st && il < m->hp.n_layer; il++) {
            struct moetax_layer *l = &m->layers[il];
            if (!l->is_moe) continue;
            const uint8_t *own = expert_mask(m, il);
            if (weight_repacked(m, &l->gate_exps)) { /* fused: the whole gate_up tensor, its halves apart */
                units[n] = l->fused_gate_up ? m->hp.n_ff_exp : l->gate_exps.ne[1];
                owns[n] = own, ws[n++] = &l->gate_exps;
            }
            if (!l->fused_gate_up && weight_repacked(m, &l->up_exps))
                units[n] = l->up_exps.ne[1], owns[n] = own, ws[n++] = &l->up_exps;
            if (weight_repacked(m, &l->down_exps)) units[n] = l->down_exps.ne[1], owns[n] = own, ws[n++] = &l->down_exps;
        }
        if (!st) st = repack_weights(m, ws, units, n, &o->rep_exp, "routed experts", owns);
        for (int il = 0; !st && il < m->hp.n_layer; il++) {
            struct moetax_layer *l = &m->layers[il];
            if (l->is_moe && l->fused_gate_up) /* up = rows F..2F-1 of each fused matrix, wherever it now is */
                l->up_exps.data = (const char *)l->gate_exps.data + (size_t)m->hp.n_ff_exp * l->gate_exps.row_bytes;
        }
        free(ws);
        free(units);
        free(owns);
        if (!st) o->experts_prepared = true;
    }
    pthread_mutex_unlock(&o->mu);
    if (!st) moetax_model_prefault(m, true); /* the experts read from the mapping */
    return st;
}

moetax_status moetax_model_set_expert_owned(struct moetax_model *m, const uint8_t *own) {
    struct owned *o = m->owned;
    const size_t n = (size_t)m->hp.n_layer * (size_t)(m->hp.n_expert > 0 ? m->hp.n_expert : 0);
    uint8_t *copy = n ? malloc(n) : NULL;
    if (n && !copy) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) copy[i] = own[i] != 0;
    pthread_mutex_lock(&o->mu);
    const bool done = o->experts_prepared;
    if (!done) {
        free(o->exp_own);
        o->exp_own = copy;
    }
    pthread_mutex_unlock(&o->mu);
    if (done) free(copy);
    return done ? moetax_error(MOETAX_ERR_ARG, "%s: the experts are prepared already", m->gguf->path) : MOETAX_OK;
}

moetax_status moetax_model_set_expert_range(struct moetax_model *m, int32_t lo, int32_t hi) {
    const int32_t E = m->hp.n_expert;
    if (lo < 0 || hi <= lo || hi > E)
        return moetax_error(MOETAX_ERR_ARG, "%s: expert range [%d, %d) is not within the model's %d experts",
                            m->gguf->path, lo, hi, E);
    uint8_t *own = calloc((size_t)m->hp.n_layer * (size_t)E, 1);
    if (!own) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    for (int il = 0; il < m->hp.n_layer; il++) memset(own + (size_t)il * (size_t)E + lo, 1, (size_t)(hi - lo));
    moetax_status st = moetax_model_set_expert_owned(m, own);
    free(own);
    return st;
}

bool moetax_model_expert_owned(const struct moetax_model *m, int il, int e) {
    const uint8_t *own = expert_mask(m, il);
    return !own || (e >= 0 && e < m->hp.n_expert && own[e]);
}

/* Expert store hook: each expert read into a slot is repacked in place (its
 * ranges are whole rows of gate [, up], down, in that order). */
static void store_repack(void *user, int layer, int e, void *const *ptrs, const uint64_t *sizes, int n_ranges) {
    (void)e;
    const struct moetax_model *m = user;
    const struct moetax_layer *l = &m->layers[layer];
    const struct moetax_weight *ws[3] = {&l->gate_exps, &l->up_exps, &l->down_exps};
    for (int i = 0, k = 0; i < 3 && k < n_ranges; i++) {
        if (i == 1 && l->fused_gate_up) continue;
        const struct moetax_weight *w = ws[i];
        /* in place; cannot fail: moetax_model_store_open checked that a row group fits the stack */
        const int64_t unit = i == 0 && l->fused_gate_up ? m->hp.n_ff_exp : w->ne[1];
        (void)repack_units(w, unit, ptrs[k], ptrs[k], (int64_t)(sizes[k] / w->row_bytes));
        k++;
    }
}

void moetax_model_free(struct moetax_model *m) {
    if (!m) return;
    struct owned *o = m->owned;
    if (o) {
        for (size_t i = 0; i < o->n; i++) free(o->ptr[i]);
        free(o->ptr);
        free(o->exp_own);
        moetax_huge_free(&o->rep_res);
        moetax_huge_free(&o->rep_exp);
        moetax_huge_free(&o->requant);
        pthread_mutex_destroy(&o->mu);
        free(o);
    }
    free(m->layers);
    moetax_gguf_close(m->gguf);
    free(m);
}

/* ---- hyper-parameters ---------------------------------------------------------- */

int32_t arch_key_i(struct arch_keys *k, const char *suffix, int64_t def, bool required) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", k->arch, suffix);
    uint32_t v;
    if (k->st) return (int32_t)def; /* keep the first error's message */
    if (!moetax_gguf_find_kv(k->g, key) && !required) return (int32_t)def;
    moetax_status st = moetax_gguf_get_u32(k->g, key, &v);
    if (st) {
        if (!k->st) k->st = st;
        return (int32_t)def;
    }
    if (v > INT32_MAX) {
        if (!k->st) k->st = moetax_error(MOETAX_ERR_FORMAT, "%s: %s = %u is out of range", k->g->path, key, v);
        return (int32_t)def;
    }
    return (int32_t)v;
}

float arch_key_f(struct arch_keys *k, const char *suffix, float def) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", k->arch, suffix);
    float v;
    if (k->st || !moetax_gguf_find_kv(k->g, key)) return def;
    moetax_status st = moetax_gguf_get_f32(k->g, key, &v);
    if (st || !isfinite(v)) {
        if (!k->st) k->st = st ? st : moetax_error(MOETAX_ERR_FORMAT, "%s: %s is not finite", k->g->path, key);
        return def;
    }
    return v;
}


bool arch_key_bool(struct arch_keys *k, const char *suffix, bool def) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", k->arch, suffix);
    bool b = def;
    moetax_status st;
    if (!k->st && moetax_gguf_find_kv(k->g, key) && (st = moetax_gguf_get_bool(k->g, key, &b))) k->st = st;
    return k->st ? def : b;
}

/* llama.cpp derives these in its context for every architecture (YaRN's attention factor
 * included); deepseek2 adds its own kq_scale from the returned mscale. */
double arch_rope_hparams(struct moetax_model *m, struct arch_keys *k_) {
    const struct moetax_gguf *g = m->gguf;
    struct moetax_hparams *hp = &m->hp;
    struct arch_keys k = *k_;
    moetax_status st;
    char key[160];
    hp->rope_freq_base = arch_key_f(&k, "rope.freq_base", 10000.0f);
    char stype[32] = "";
    snprintf(key, sizeof key, "%s.rope.scaling.type", hp->arch);
    /* only when present, and never over an earlier error: the first error's message wins */
    if (!k.st && moetax_gguf_find_kv(g, key) && (st = moetax_gguf_get_str(g, key, stype, sizeof stype))) k.st = st;
    float factor = arch_key_f(&k, "rope.scaling.factor", 0.0f);
    if (factor == 0.0f) factor = arch_key_f(&k, "rope.scale_linear", 0.0f);
    float fs = factor == 0.0f ? 1.0f : 1.0f / factor;
    if (!strcmp(stype, "none")) fs = 1.0f;
    float ext = arch_key_f(&k, "rope.scaling.yarn_ext_factor", -1.0f);
    if (ext < 0.0f) ext = !strcmp(stype, "yarn") ? 1.0f : 0.0f;
    double L = arch_key_f(&k, "rope.scaling.yarn_log_multiplier", 0.0f) / 0.1;
    double A = arch_key_f(&k, "rope.scaling.attn_factor", 1.0f);
    double lnF = log(1.0 / fs);
    double af = 1.0;
    if (ext != 0.0f) {
        if (L == 0.0) af = fs >= 1.0f ? 1.0 : 1.0 + 0.1 * lnF;
        af *= 1.0 / (1.0 + 0.1 * lnF);
    }
    af *= A;
    double mscale = af * (1.0 + 0.1 * lnF) * (1.0 + 0.1 * L * lnF);
    hp->rope_freq_scale = fs;
    hp->rope_ext_factor = ext;
    hp->rope_attn_factor = (float)af;
    hp->rope_beta_fast = arch_key_f(&k, "rope.scaling.yarn_beta_fast", 32.0f);
    hp->rope_beta_slow = arch_key_f(&k, "rope.scaling.yarn_beta_slow", 1.0f);
    hp->rope_n_ctx_orig = arch_key_i(&k, "rope.scaling.original_context_length", 0, false);
    if (hp->rope_n_ctx_orig <= 0) hp->rope_n_ctx_orig = hp->n_ctx_train;
    *k_ = k;
    return mscale;
}

moetax_status arch_check_moe(struct moetax_model *m, int first_moe) {
    const struct moetax_gguf *g = m->gguf;
    struct moetax_hparams *hp = &m->hp;
#define NEED(cond, ...) do { if (!(cond)) return moetax_error(MOETAX_ERR_FORMAT, __VA_ARGS__); } while (0)
    if (first_moe >= hp->n_layer) {
        /* no MoE layer: the expert keys are bound to no tensor, so nothing checks them; a dense model (they
         * would otherwise size buffers, and a crafted count asked for 135 GB of them) */
        hp->n_expert = hp->n_expert_used = hp->n_expert_shared = hp->n_ff_exp = hp->n_ff_shexp = 0;
        hp->n_expert_group = hp->n_expert_group_used = 0;
    } else {
        NEED(hp->n_expert > 0, "%s: layers %d.. are MoE layers but expert_count is 0", g->path, first_moe);
        NEED(hp->n_expert_used > 0 && hp->n_expert_used <= hp->n_expert && hp->n_expert_used <= 256,
             "%s: expert_used_count %d must be in 1..min(expert_count %d, 256)", g->path, hp->n_expert_used, hp->n_expert);
        NEED(hp->n_ff_exp > 0, "%s: expert_feed_forward_length must be positive", g->path);
        NEED(hp->gating_func == 1 || hp->gating_func == 2, "%s: expert_gating_func %d (expected 1 softmax or 2 sigmoid)",
             g->path, hp->gating_func);
        if (hp->n_expert_group > 1) {
            NEED(hp->n_expert_group <= 256, "%s: expert_group_count %d is more than moetax supports (256)", g->path,
                 hp->n_expert_group);
            NEED(hp->n_expert % hp->n_expert_group == 0 && hp->n_expert / hp->n_expert_group >= 2,
                 "%s: expert_group_count %d must divide expert_count %d into groups of >= 2", g->path,
                 hp->n_expert_group, hp->n_expert);
            NEED(hp->n_expert_group_used >= 1 && hp->n_expert_group_used <= hp->n_expert_group &&
                     hp->n_expert_group_used * (hp->n_expert / hp->n_expert_group) >= hp->n_expert_used,
                 "%s: expert_group_used_count %d cannot supply %d experts", g->path, hp->n_expert_group_used,
                 hp->n_expert_used);
        }
    }
#undef NEED
    return MOETAX_OK;
}

moetax_status arch_gqa_finish(struct moetax_model *m, struct arch_keys *k) {
    (void)arch_rope_hparams(m, k);
    m->hp.kq_scale = (float)(1.0 / sqrt((double)m->hp.n_embd_head_k));
    if (k->st) return k->st;
    return moetax_hparams_check(&m->hp, m->gguf->path);
}

moetax_status arch_gqa_hparams(struct moetax_model *m, struct arch_keys *k) {
    const struct moetax_gguf *g = m->gguf;
    struct moetax_hparams *hp = &m->hp;
    hp->attn = MOETAX_ATTN_GQA;
    hp->n_ctx_train = arch_key_i(k, "context_length", 4096, false);
    hp->n_embd = arch_key_i(k, "embedding_length", 0, true);
    hp->n_layer = arch_key_i(k, "block_count", 0, true);
    hp->n_head = arch_key_i(k, "attention.head_count", 0, true);
    if (k->st) return k->st;
    if (hp->n_embd <= 0 || hp->n_layer <= 0 || hp->n_head <= 0)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: embedding_length, block_count and head_count must be positive",
                            g->path);
    hp->n_head_kv = arch_key_i(k, "attention.head_count_kv", hp->n_head, false);
    hp->n_embd_head_k = arch_key_i(k, "attention.key_length", hp->n_embd / hp->n_head, false);
    hp->n_embd_head_v = arch_key_i(k, "attention.value_length", hp->n_embd / hp->n_head, false);
    hp->n_rot = arch_key_i(k, "rope.dimension_count", hp->n_embd_head_k, false);
    hp->n_embd_head_qk_rope = hp->n_rot;
    hp->n_ff = arch_key_i(k, "feed_forward_length", 0, false);
    hp->n_expert = arch_key_i(k, "expert_count", 0, !k->dense);
    hp->n_expert_used = arch_key_i(k, "expert_used_count", 0, !k->dense);
    hp->rms_eps = arch_key_f(k, "attention.layer_norm_rms_epsilon", NAN);
    if (k->st) return k->st;
#define NEED(cond, ...) do { if (!(cond)) return moetax_error(MOETAX_ERR_FORMAT, __VA_ARGS__); } while (0)
    NEED(!isnan(hp->rms_eps), "%s: %s.attention.layer_norm_rms_epsilon is missing", g->path, hp->arch);
    NEED(hp->n_head_kv >= 1 && hp->n_head % hp->n_head_kv == 0,
         "%s: attention.head_count_kv %d must divide head_count %d", g->path, hp->n_head_kv, hp->n_head);
    NEED(hp->n_embd_head_k >= 2 && hp->n_embd_head_k <= MOETAX_ROPE_MAX_DIMS && hp->n_embd_head_k % 2 == 0 &&
             hp->n_embd_head_v == hp->n_embd_head_k && hp->n_rot == hp->n_embd_head_k,
         "%s: attention.key_length %d, value_length %d and rope.dimension_count %d must be equal, even and in "
         "2..%d (llama.cpp's %s graph requires the same)", g->path, hp->n_embd_head_k, hp->n_embd_head_v,
         hp->n_rot, MOETAX_ROPE_MAX_DIMS, hp->arch);
    NEED(k->dense || hp->n_expert > 0, "%s: %s.expert_count must be positive (moetax runs %s files with experts only)",
         g->path, hp->arch, hp->arch);
    if (k->dense) { /* every layer a dense SwiGLU FFN feed_forward_length wide */
        NEED(hp->n_ff > 0, "%s: %s.feed_forward_length must be positive in a dense model", g->path, hp->arch);
        hp->n_expert = hp->n_expert_used = 0;
        hp->n_layer_dense_lead = hp->n_layer;
    }
#undef NEED
    return MOETAX_OK;
}

/* ---- tensors ------------------------------------------------------------------- */

static void fmt_shape(char *buf, size_t cap, int n, const int64_t *ne) {
    int o = snprintf(buf, cap, "{");
    for (int i = 0; i < n; i++) o += snprintf(buf + o, cap - (size_t)o, "%s%lld", i ? ", " : "", (long long)ne[i]);
    snprintf(buf + o, cap - (size_t)o, "}");
}

/* The alignment the kernels and converters read a type's elements (blocks) with. */
static size_t type_align(enum moetax_type t) {
    switch (t) {
    case MOETAX_TYPE_F32: return _Alignof(float);
    case MOETAX_TYPE_Q8_0: return _Alignof(moetax_block_q8_0);
    case MOETAX_TYPE_Q4_0: return _Alignof(moetax_block_q4_0);
    case MOETAX_TYPE_Q5_0: return _Alignof(moetax_block_q5_0);
    case MOETAX_TYPE_Q4_1: return _Alignof(moetax_block_q4_1);
    case MOETAX_TYPE_Q5_1: return _Alignof(moetax_block_q5_1);
    case MOETAX_TYPE_IQ4_NL: return _Alignof(moetax_block_iq4_nl);
    default: return _Alignof(uint16_t); /* F16, BF16 */
    }
}

static bool tensor_aligned(const struct moetax_gguf_tensor *t) {
    return (uintptr_t)t->data % type_align(t->type) == 0;
}

/* Bind tensor `name` with the expected shape; absent + !required leaves w->data NULL.
 * w->file_data points into the mapping; w->data too, unless the tensor lies at an
 * offset its type cannot be read from (then an aligned private copy). */
moetax_status arch_bind(struct moetax_model *m, struct moetax_weight *w, const char *name, bool required, int n_dims,
                       int64_t ne0, int64_t ne1, int64_t ne2) {
    memset(w, 0, sizeof *w);
    const struct moetax_gguf_tensor *t = moetax_gguf_find_tensor(m->gguf, name);
    if (!t) {
        if (!required) return MOETAX_OK;
        return moetax_error(MOETAX_ERR_NOT_FOUND, "%s: tensor '%s' is missing", m->gguf->path, name);
    }
    int64_t want[4] = {ne0, ne1, ne2, 1};
    int td = (int)t->n_dims;
    while (td > 1 && t->ne[td - 1] == 1) td--;
    int wd = n_dims;
    while (wd > 1 && want[wd - 1] == 1) wd--;
    bool ok = td == wd;
    for (int i = 0; ok && i < 4; i++) ok = t->ne[i] == want[i];
    if (!ok) {
        char a[96], b[96];
        fmt_shape(a, sizeof a, (int)t->n_dims, t->ne);
        fmt_shape(b, sizeof b, n_dims, want);
        return moetax_error(MOETAX_ERR_SHAPE, "%s: tensor '%s' has shape %s but the metadata implies %s", m->gguf->path,
                            name, a, b);
    }
    if (!moetax_type_supported(t->type))
        return moetax_error(MOETAX_ERR_UNSUPPORTED, "%s: tensor '%s' has type %s; moetax computes with f32, f16, bf16, q8_0, q4_0, q4_1, "
                            "q5_0, q5_1, iq4_nl, q2_k, q3_k, q4_k, q5_k and q6_k",
                            m->gguf->path, name, moetax_type_name(t->type));
    w->data = t->data;
    w->file_data = t->data;
    if (!tensor_aligned(t)) {
        /* valid GGUF (general.alignment 1, odd offsets), but the kernels and converters read
         * elements and blocks through typed pointers: they read an aligned private copy */
        void *copy = arch_own(m, (size_t)t->nbytes);
        if (!copy)
            return moetax_error(MOETAX_ERR_NOMEM, "%s: tensor '%s': no memory for an aligned copy of %llu bytes",
                                m->gguf->path, name, (unsigned long long)t->nbytes);
        memcpy(copy, t->data, (size_t)t->nbytes);
        w->data = copy;
    }
    w->type = t->type;
    w->ne[0] = t->ne[0];
    w->ne[1] = t->ne[1];
    w->ne[2] = t->ne[2];
    w->row_bytes = moetax_row_size(t->type, t->ne[0]);
    w->mat_bytes = w->row_bytes * (size_t)t->ne[1];
    if (moetax_act_is_q8_0(t->type)) m->has_q8_0 = true;
    if (moetax_act_is_q4_0(t->type)) m->has_q4_0 = true;
    if (moetax_type_is_kquant(t->type)) m->has_kq = true;
    return MOETAX_OK;
}

/* A vector tensor converted to an owned F32 copy. */
moetax_status arch_bind_vec(struct moetax_model *m, float **out, const char *name, bool required, int64_t n) {
    struct moetax_weight w;
    moetax_status st = arch_bind(m, &w, name, required, 1, n, 1, 1);
    *out = NULL;
    if (st || !w.data) return st;
    float *v = arch_own(m, sizeof(float) * (size_t)n);
    if (!v) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    moetax_to_float(w.type, w.data, v, n);
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(v[i])) return moetax_error(MOETAX_ERR_FORMAT, "%s: tensor '%s' holds a non-finite value at %lld",
                                                 m->gguf->path, name, (long long)i);
    *out = v;
    return MOETAX_OK;
}


moetax_status arch_bind_ffn(struct moetax_model *m, int il) {
    const struct moetax_hparams *hp = &m->hp;
    struct moetax_layer *l = &m->layers[il];
    const int64_t d = hp->n_embd, E = hp->n_expert, F = hp->n_ff_exp;
    const int64_t Fs = hp->n_ff_shexp > 0 ? hp->n_ff_shexp : (int64_t)hp->n_expert_shared * hp->n_ff_exp;
    char n[128];
    moetax_status st;
#define NAME(s) (snprintf(n, sizeof n, "blk.%d." s, il), n)
#define TRY(x) do { if ((st = (x))) return st; } while (0)
    TRY(arch_bind_vec(m, &l->ffn_norm, NAME("ffn_norm.weight"), true, d));
    l->is_moe = il >= hp->n_layer_dense_lead;
    if (!l->is_moe) {
        int64_t ff = hp->n_ff;
        snprintf(n, sizeof n, "%s.feed_forward_length", hp->arch);
        const struct moetax_gguf_kv *ffkv = moetax_gguf_find_kv(m->gguf, n);
        if (ffkv && ffkv->type == MOETAX_GGUF_TYPE_ARRAY && (!moetax_gguf_arr_i64(ffkv, (uint64_t)il, &ff) || ff < 1))
            return moetax_error(MOETAX_ERR_FORMAT, "%s: %s[%d] is not a positive integer", m->gguf->path, n, il);
        TRY(arch_bind(m, &l->ffn_gate, NAME("ffn_gate.weight"), true, 2, d, ff, 1));
        TRY(arch_bind(m, &l->ffn_up, NAME("ffn_up.weight"), true, 2, d, ff, 1));
        TRY(arch_bind(m, &l->ffn_down, NAME("ffn_down.weight"), true, 2, ff, d, 1));
        return MOETAX_OK;
    }
    TRY(arch_bind(m, &l->gate_inp, NAME("ffn_gate_inp.weight"), true, 2, d, E, 1));
    TRY(arch_bind_vec(m, &l->exp_probs_b, NAME("exp_probs_b.bias"), false, E));
    TRY(arch_bind(m, &l->gate_exps, NAME("ffn_gate_up_exps.weight"), false, 3, d, 2 * F, E));
    if (l->gate_exps.data) {
        l->fused_gate_up = true;
        /* up = rows F..2F-1 of each expert's fused matrix */
        l->up_exps = l->gate_exps;
        l->up_exps.data = (const char *)l->gate_exps.data + (size_t)F * l->gate_exps.row_bytes;
        l->up_exps.file_data = (const char *)l->gate_exps.file_data + (size_t)F * l->gate_exps.row_bytes;
    } else {
        TRY(arch_bind(m, &l->gate_exps, NAME("ffn_gate_exps.weight"), true, 3, d, F, E));
        TRY(arch_bind(m, &l->up_exps, NAME("ffn_up_exps.weight"), true, 3, d, F, E));
    }
    TRY(arch_bind(m, &l->down_exps, NAME("ffn_down_exps.weight"), true, 3, F, d, E));
    if (Fs > 0) {
        TRY(arch_bind(m, &l->gate_sh, NAME("ffn_gate_shexp.weight"), true, 2, d, Fs, 1));
        TRY(arch_bind(m, &l->up_sh, NAME("ffn_up_shexp.weight"), true, 2, d, Fs, 1));
        TRY(arch_bind(m, &l->down_sh, NAME("ffn_down_shexp.weight"), true, 2, Fs, d, 1));
    }
#undef NAME
#undef TRY
    return MOETAX_OK;
}

/* ---- architectures (src/model/arch_*.c) ------------------------------------------- */

static const struct moetax_arch *const archs[] = {
    &moetax_arch_deepseek2,
    &moetax_arch_qwen3moe,
    &moetax_arch_qwen2moe,
    &moetax_arch_qwen3,
    &moetax_arch_qwen2,
    &moetax_arch_olmoe,
    &moetax_arch_llama,
};

static moetax_status load_hparams(struct moetax_model *m) {
    const struct moetax_gguf *g = m->gguf;
    moetax_status st = moetax_gguf_get_str(g, "general.architecture", m->hp.arch, sizeof m->hp.arch);
    if (st) return st;
    char names[160] = "";
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++) {
        if (!strcmp(m->hp.arch, archs[i]->name)) {
            m->arch = archs[i];
            return archs[i]->load_hparams(m);
        }
        snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", i ? ", " : "", archs[i]->name);
    }
    return moetax_error(MOETAX_ERR_UNSUPPORTED, "%s: architecture '%s' is not supported yet (moetax runs %s)", g->path,
                        m->hp.arch, names);
}

static moetax_status bind_layer(struct moetax_model *m, int il) {
    return m->arch->bind_layer(m, il);
}

/* Before anything is allocated per layer: block_count must be plausible against
 * the tensors the file has (a layer has at least 7), and its last layer present. */
static moetax_status check_layer_count(const struct moetax_model *m) {
    const struct moetax_gguf *g = m->gguf;
    const int32_t n = m->hp.n_layer;
    char name[64];
    snprintf(name, sizeof name, "blk.%d.attn_norm.weight", n - 1);
    if ((uint64_t)n > g->n_tensors / 7)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: %s.block_count = %d but the file has %llu tensors (a layer needs at least 7)",
                            g->path, m->hp.arch, n, (unsigned long long)g->n_tensors);
    if (!moetax_gguf_find_tensor(g, name))
        return moetax_error(MOETAX_ERR_NOT_FOUND, "%s: %s.block_count = %d but tensor '%s' is missing", g->path,
                            m->hp.arch, n, name);
    return MOETAX_OK;
}

moetax_status moetax_model_load(const char *path, struct moetax_model **out) {
    return moetax_model_load_ex(path, NULL, out);
}

/* Open the file (path) or parse the buffer (buf, size: moetax_model_load_memory), then bind. */
static moetax_status load(const char *path, const void *buf, size_t size, const struct moetax_model_params *p,
                          struct moetax_model **out) {
    *out = NULL;
    struct moetax_model *m = calloc(1, sizeof *m);
    if (!m) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    m->owned = calloc(1, sizeof(struct owned));
    if (m->owned) {
        pthread_mutex_init(&((struct owned *)m->owned)->mu, NULL);
        ((struct owned *)m->owned)->copy_all = p && p->no_mmap;
    }
    moetax_status st = !m->owned ? moetax_error(MOETAX_ERR_NOMEM, "out of memory")
                       : path    ? moetax_gguf_open(path, &m->gguf)
                                 : moetax_gguf_open_memory(buf, size, &m->gguf);
    if (!st) path = m->gguf->path;
    if (!st) st = load_hparams(m);
    if (!st) {
        const struct moetax_gguf_tensor *te = moetax_gguf_find_tensor(m->gguf, "token_embd.weight");
        if (!te) st = moetax_error(MOETAX_ERR_NOT_FOUND, "%s: tensor 'token_embd.weight' is missing", path);
        else if (te->ne[1] > INT32_MAX) st = moetax_error(MOETAX_ERR_FORMAT, "%s: vocabulary too large", path);
        else m->hp.n_vocab = (int32_t)te->ne[1];
    }
    if (!st) st = arch_bind(m, &m->tok_embd, "token_embd.weight", true, 2, m->hp.n_embd, m->hp.n_vocab, 1);
    if (!st) st = arch_bind_vec(m, &m->output_norm, "output_norm.weight", true, m->hp.n_embd);
    if (!st) st = arch_bind(m, &m->output, "output.weight", false, 2, m->hp.n_embd, m->hp.n_vocab, 1);
    if (!st && !m->output.data) m->output = m->tok_embd;
    if (!st) st = check_layer_count(m);
    if (!st) {
        m->layers = calloc((size_t)m->hp.n_layer, sizeof *m->layers);
        if (!m->layers) st = moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    }
    for (int il = 0; !st && il < m->hp.n_layer; il++) st = bind_layer(m, il);
    if (!st && p && p->expert_type != MOETAX_EXPERT_TYPE_AS_STORED)
        st = model_requant_experts(m, p->expert_type, &((struct owned *)m->owned)->requant);
    if (!st) st = repack_resident(m);
    if (!st) moetax_model_prefault(m, false);
    if (st) {
        moetax_model_free(m);
        return st;
    }
    *out = m;
    return MOETAX_OK;
}

moetax_status moetax_model_load_ex(const char *path, const struct moetax_model_params *p, struct moetax_model **out) {
    if (!path) {
        *out = NULL;
        return moetax_error(MOETAX_ERR_ARG, "no model file given");
    }
    moetax_status st = load(path, NULL, 0, p, out);
#ifdef MOETAX_WITH_MPI
    st = moetax_dist_model_loaded(st, out); /* under mpirun: every rank's result, the same file, own experts */
#endif
    return st;
}

moetax_status moetax_model_load_memory(const void *buf, size_t size, const struct moetax_model_params *p,
                                       struct moetax_model **out) {
    return load(NULL, buf, size, p, out);
}

moetax_status moetax_model_weight_pages(const struct moetax_model *m, uint64_t *resident, uint64_t *huge) {
    struct owned *o = m->owned;
    /* with no_mmap the mapping holds only what the kernels never stream (token_embd, read by
     * rows; the metadata) */
    pthread_mutex_lock(&o->mu); /* rep_exp is set by moetax_model_prepare_experts */
    const void *at[4] = {m->gguf->mapped && !o->copy_all ? m->gguf->base : NULL, o->rep_res.ptr, o->rep_exp.ptr,
                         o->requant.ptr};
    pthread_mutex_unlock(&o->mu);
    *resident = *huge = 0;
    for (int i = 0; i < 4; i++) {
        if (!at[i]) continue;
        struct moetax_mem_paging pg;
        moetax_status st = moetax_mem_pages(at[i], &pg);
        if (st) return st;
        *resident += pg.resident;
        *huge += pg.huge;
    }
    return MOETAX_OK;
}

double moetax_model_active_bytes(const struct moetax_model *m) { return moetax_model_active_bytes_k(m, 0); }

double moetax_model_active_bytes_k(const struct moetax_model *m, int n_expert_used) {
    const struct moetax_hparams *hp = &m->hp;
    const int k = n_expert_used > 0 ? n_expert_used : hp->n_expert_used;
    double frac = hp->n_expert ? (double)k / hp->n_expert : 0;
    double b = (double)m->tok_embd.row_bytes + (double)m->output.mat_bytes;
    for (int il = 0; il < hp->n_layer; il++) {
        const struct moetax_layer *l = &m->layers[il];
        const struct moetax_weight *ws[] = {&l->wq, &l->wq_a, &l->wq_b, &l->wkv_a, &l->wk_b, &l->wv_b, &l->wo,
                                            &l->ffn_gate, &l->ffn_up, &l->ffn_down, &l->gate_inp, &l->gate_sh,
                                            &l->up_sh, &l->down_sh, &l->wk, &l->wv};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++)
            if (ws[i]->data) b += (double)ws[i]->mat_bytes * (double)(ws[i]->ne[2] > 0 ? ws[i]->ne[2] : 1);
        if (l->is_moe) {
            double ex = (double)l->gate_exps.mat_bytes * (l->fused_gate_up ? 1 : 2) + (double)l->down_exps.mat_bytes;
            b += ex * (double)hp->n_expert * frac;
        }
        b += sizeof(float) * (double)hp->n_embd * 2; /* norms */
    }
    return b;
}

/* ---- expert store ---------------------------------------------------------------- */

moetax_status moetax_model_check_experts_used(const struct moetax_model *m, int k) {
    const struct moetax_hparams *hp = &m->hp;
    if (k == 0) return MOETAX_OK;
    if (hp->n_expert <= 0)
        return moetax_error(MOETAX_ERR_ARG, "experts used %d: %s has no routed experts", k, m->gguf->path);
    int64_t max = hp->n_expert;
    if (hp->n_expert_group > 1) max = (int64_t)hp->n_expert_group_used * (hp->n_expert / hp->n_expert_group);
    if (max > 256) max = 256;
    if (k < 1 || k > max)
        return moetax_error(MOETAX_ERR_ARG, "experts used %d: must be in 1..%lld (%d experts%s; the file says %d)", k,
                            (long long)max, hp->n_expert,
                            hp->n_expert_group > 1 ? " in the groups a token may use" : "", hp->n_expert_used);
    return MOETAX_OK;
}

/* Register every routed expert this process reads (the rows of gate/up/down of each, as file ranges);
 * *n_out (optional) counts them. */
static moetax_status store_add_experts(const struct moetax_model *m, struct moetax_store *s, int64_t *n_out) {
    moetax_status st = MOETAX_OK;
    int64_t n_added = 0;
    for (int il = 0; !st && il < m->hp.n_layer; il++) {
        const struct moetax_layer *l = &m->layers[il];
        if (!l->is_moe) continue;
        for (int e = 0; !st && e < m->hp.n_expert; e++) {
            if (!moetax_model_expert_owned(m, il, e)) continue; /* another rank's */
            uint64_t off[3], sz[3];
            int n = 0;
            const struct moetax_weight *ws[3] = {&l->gate_exps, &l->up_exps, &l->down_exps};
            for (int i = 0; i < 3; i++) {
                if (i == 1 && l->fused_gate_up) continue; /* gate_up: one range of 2F rows */
                size_t bytes = ws[i]->mat_bytes; /* fused: gate_exps holds the 2F-row matrix */
                const uint8_t *base = (const uint8_t *)ws[i]->file_data + (size_t)e * bytes;
                off[n] = (uint64_t)(base - m->gguf->base);
                sz[n] = bytes;
                n++;
            }
            st = moetax_store_add_expert(s, il, e, off, sz, n);
            n_added++;
        }
    }
    if (n_out) *n_out = n_added;
    return st;
}

/* A store of the model's routed experts that is never committed (no file opened, no slots, no threads):
 * its slot size; *n_out the experts registered. */
static moetax_status probe_store(const struct moetax_model *m, struct moetax_store **out, int64_t *n_out) {
    struct moetax_store_params p = {.path = m->gguf->path};
    moetax_status st = moetax_store_init(&p, m->hp.n_layer, m->hp.n_expert, out);
    if (!st) st = store_add_experts(m, *out, n_out);
    return st;
}

/* The experts a token pins in the store at once: its top-k (n_expert_used, 0: the model's), at most
 * the most routed experts this process owns in any layer (under expert parallelism the store holds
 * this rank's own); *own_max_out: that most. */
static int store_k(const struct moetax_model *m, int n_expert_used, int32_t *own_max_out) {
    const struct moetax_hparams *hp = &m->hp;
    int k = n_expert_used ? n_expert_used : hp->n_expert_used;
    int32_t own_max = 0;
    for (int il = 0; il < hp->n_layer; il++) {
        int32_t c = 0;
        for (int e = 0; m->layers[il].is_moe && e < hp->n_expert; e++) c += moetax_model_expert_owned(m, il, e);
        own_max = c > own_max ? c : own_max;
    }
    if (own_max < 1) own_max = 1;
    if (own_max_out) *own_max_out = own_max;
    return k > own_max ? own_max : k;
}

/* A budget whose slots (of slot bytes each) do not hold a token's k experts. */
static moetax_status budget_too_small(uint64_t budget, uint64_t slot, int k, uint64_t least) {
    return moetax_error(MOETAX_ERR_ARG,
                        "expert budget of %.3f MiB holds %lld experts of %.3f MiB each, but a token uses %d: "
                        "give at least %.3f MiB",
                        (double)budget / (1 << 20), (long long)(slot ? budget / slot : 0), (double)slot / (1 << 20), k,
                        (double)least / (1 << 20));
}

/* What an expert store needs of the model: routed experts, a valid top-k, the experts as stored in the
 * file, and their tensors at offsets the store's reads can take. */
static moetax_status store_usable(const struct moetax_model *m, int n_expert_used) {
    if (m->hp.n_expert <= 0) return moetax_error(MOETAX_ERR_ARG, "%s: the model has no routed experts", m->gguf->path);
    moetax_status st = moetax_model_check_experts_used(m, n_expert_used);
    if (st) return st;
    if (model_experts_requantized(m))
        return moetax_error(MOETAX_ERR_UNSUPPORTED, "%s: the routed experts were re-quantized at load (--expert-type) "
                            "and the expert store reads them as stored in the file: give --expert-type or "
                            "--expert-budget, not both", m->gguf->path);
    for (uint64_t i = 0; i < m->gguf->n_tensors; i++) {
        const struct moetax_gguf_tensor *t = &m->gguf->tensors[i];
        /* the store reads an expert's rows to their file offset modulo 4096 in a slot */
        if (moetax_tensor_is_routed_expert(t) && !tensor_aligned(t))
            return moetax_error(MOETAX_ERR_UNSUPPORTED,
                                "%s: tensor '%.*s' lies at file offset %llu, not a multiple of %zu (general.alignment "
                                "%u): the expert store cannot read it; run without --expert-budget",
                                m->gguf->path, (int)t->name.len, t->name.data,
                                (unsigned long long)(m->gguf->data_offset + t->offset), type_align(t->type),
                                m->gguf->alignment);
    }
    return MOETAX_OK;
}

moetax_status moetax_model_store_check_budget(const struct moetax_model *m, uint64_t budget, int n_expert_used) {
    moetax_status st = store_usable(m, n_expert_used);
    if (st) return st;
    struct moetax_store *s = NULL;
    if (!(st = probe_store(m, &s, NULL))) {
        const int k = store_k(m, n_expert_used, NULL);
        const uint64_t slot = moetax_store_slot_bytes(s);
        if (!slot || budget / slot < (uint64_t)k) st = budget_too_small(budget, slot, k, moetax_store_min_budget(s, k));
    }
    moetax_store_free(s);
    return st;
}

uint64_t moetax_model_store_bytes_all(const struct moetax_model *m) {
    if (m->hp.n_expert <= 0) return 0;
    struct moetax_store *s = NULL;
    int64_t n = 0;
    moetax_status st = probe_store(m, &s, &n);
    uint64_t b = st ? 0 : moetax_store_slot_bytes(s) * (uint64_t)n;
    moetax_store_free(s);
    return b;
}

moetax_status moetax_model_store_open(const struct moetax_model *m, const struct moetax_store_params *sp,
                                      int n_ubatch, int n_expert_used, struct moetax_store **out,
                                      int *n_ubatch_out) {
    const struct moetax_hparams *hp = &m->hp;
    *out = NULL;
    moetax_status cst = store_usable(m, n_expert_used);
    if (cst) return cst;
    struct moetax_store_params p = *sp;
    if (!p.path) p.path = m->gguf->path;
    for (int il = 0; il < hp->n_layer; il++) {
        const struct moetax_layer *l = &m->layers[il];
        /* the store's slots are private memory already: only a repacked layout needs the hook */
        if (l->is_moe && (kernels_repack(l->gate_exps.type) || kernels_repack(l->up_exps.type) ||
                          kernels_repack(l->down_exps.type))) {
            const size_t wide = l->gate_exps.row_bytes > l->down_exps.row_bytes ? l->gate_exps.row_bytes
                                                                                  : l->down_exps.row_bytes;
            if ((size_t)MOETAX_KERNELS_ROW_GROUP * wide > MOETAX_KERNELS_REPACK_STACK)
                return moetax_error(MOETAX_ERR_ARG,
                                    "%s: expert rows of %zu bytes are too wide for the expert store's in-place "
                                    "repack (at most %d bytes); run without --expert-budget",
                                    m->gguf->path, wide, MOETAX_KERNELS_REPACK_STACK / MOETAX_KERNELS_ROW_GROUP);
            p.on_load = store_repack; /* slots hold the experts in the kernels' layout */
            p.on_load_user = (void *)m;
            break;
        }
    }
    if (n_ubatch < 1) n_ubatch = 64;
    /* Expert parallelism: the store holds this process's own experts only (the budget is per
     * rank), so a layer pins at most the most experts it owns in any layer */
    int32_t own_max = 0;
    const int k = store_k(m, n_expert_used, &own_max);
    /* experts pinned at once: every active expert of one layer for a micro-batch */
    int min_slots = n_ubatch * k < own_max ? n_ubatch * k : own_max;
    p.min_slots = min_slots;
    struct moetax_store *s = NULL;
    moetax_status st = moetax_store_init(&p, hp->n_layer, hp->n_expert, &s);
    if (!st) st = store_add_experts(m, s, NULL);
    if (!st) {
        /* fit the micro-batch to the budget: at most n_slots experts pinned at once */
        uint64_t slot = moetax_store_slot_bytes(s);
        int64_t n_slots = slot ? (int64_t)(p.budget_bytes / slot) : 0;
        if (n_slots < k) {
            st = budget_too_small(p.budget_bytes, slot, k, moetax_store_min_budget(s, k));
        } else if (n_slots < min_slots) {
            n_ubatch = (int)(n_slots / k);
            moetax_store_free(s);
            s = NULL;
            p.min_slots = n_ubatch * k < own_max ? n_ubatch * k : own_max;
            return moetax_model_store_open(m, &p, n_ubatch, n_expert_used, out, n_ubatch_out);
        }
    }
    if (!st) st = moetax_store_commit(s);
    if (st) {
        moetax_store_free(s);
        return st;
    }
    *out = s;
    if (n_ubatch_out) *n_ubatch_out = n_ubatch;
    return MOETAX_OK;
}
