/*
 * gguf_read.c - GGUF reader: mmap the file, parse with a bounds-checked cursor,
 * validate every tensor, index names with a hash table.
 *
 * Every read goes through struct cursor, whose functions check the remaining
 * bytes before touching memory and report the byte offset and the field on
 * failure. Every tensor's size goes through moetax_tensor_nbytes (types.c), the
 * one overflow-checked helper for sizes computed from file values.
 */
#include "moetax/gguf.h"

#include <errno.h>
#include <stdio.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf/gguf_impl.h"

#define MAX_ARRAY_DEPTH 8

struct cursor {
    const uint8_t *base;
    uint64_t size;
    uint64_t pos;
    const char *path;
};

/* ---- name index (open addressing, FNV-1a) ---------------------------------- */

struct name_index {
    uint64_t cap;     /* power of two */
    int64_t *kv_slot; /* index into g->kv or -1 */
    int64_t *t_slot;  /* index into g->tensors or -1 */
};

uint64_t moetax_gguf_hash(const char *s, uint64_t n) {
    uint64_t h = 14695981039346656037ull;
    for (uint64_t i = 0; i < n; i++) {
        h ^= (uint8_t)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

static bool str_eq(struct moetax_gguf_str a, const char *b, uint64_t bn) {
    return a.len == bn && memcmp(a.data, b, bn) == 0;
}

const char *moetax_gguf_type_name(enum moetax_gguf_type t) {
    static const char *names[] = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
                                  "bool", "string", "array", "uint64", "int64", "float64"};
    return (unsigned)t < MOETAX_GGUF_TYPE_COUNT ? names[t] : "unknown";
}

size_t moetax_gguf_type_size(enum moetax_gguf_type t) {
    switch (t) {
    case MOETAX_GGUF_TYPE_UINT8: case MOETAX_GGUF_TYPE_INT8: case MOETAX_GGUF_TYPE_BOOL: return 1;
    case MOETAX_GGUF_TYPE_UINT16: case MOETAX_GGUF_TYPE_INT16: return 2;
    case MOETAX_GGUF_TYPE_UINT32: case MOETAX_GGUF_TYPE_INT32: case MOETAX_GGUF_TYPE_FLOAT32: return 4;
    case MOETAX_GGUF_TYPE_UINT64: case MOETAX_GGUF_TYPE_INT64: case MOETAX_GGUF_TYPE_FLOAT64: return 8;
    default: return 0;
    }
}

/* ---- cursor ------------------------------------------------------------------ */

static moetax_status need(struct cursor *c, uint64_t n, const char *field) {
    if (n > c->size - c->pos)
        return moetax_error(MOETAX_ERR_FORMAT,
                            "%s: byte %llu: %s: needs %llu bytes but the file ends at byte %llu (truncated?)",
                            c->path, (unsigned long long)c->pos, field, (unsigned long long)n,
                            (unsigned long long)c->size);
    return MOETAX_OK;
}

static moetax_status rd(struct cursor *c, void *dst, uint64_t n, const char *field) {
    moetax_status st = need(c, n, field);
    if (st) return st;
    memcpy(dst, c->base + c->pos, n);
    c->pos += n;
    return MOETAX_OK;
}

static moetax_status rd_u32(struct cursor *c, uint32_t *v, const char *f) { return rd(c, v, 4, f); }
static moetax_status rd_u64(struct cursor *c, uint64_t *v, const char *f) { return rd(c, v, 8, f); }

bool moetax_utf8_valid(const char *s, uint64_t n) {
    const uint8_t *p = (const uint8_t *)s;
    uint64_t i = 0;
    while (i < n) {
        uint8_t b = p[i];
        if (b == 0) return false;
        if (b < 0x80) { i++; continue; }
        int len;
        uint32_t cp;
        if ((b & 0xe0) == 0xc0) { len = 2; cp = b & 0x1f; }
        else if ((b & 0xf0) == 0xe0) { len = 3; cp = b & 0x0f; }
        else if ((b & 0xf8) == 0xf0) { len = 4; cp = b & 0x07; }
        else return false;
        if ((uint64_t)len > n - i) return false;
        for (int k = 1; k < len; k++) {
            if ((p[i + k] & 0xc0) != 0x80) return false;
            cp = (cp << 6) | (p[i + k] & 0x3f);
        }
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000)) return false;
        if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
        i += (uint64_t)len;
    }
    return true;
}

/* A string: u64 length + bytes. `name` true: must be a non-empty valid UTF-8 name. */
static moetax_status rd_str(struct cursor *c, struct moetax_gguf_str *s, const char *field, bool name) {
    uint64_t at = c->pos;
    moetax_status st = rd_u64(c, &s->len, field);
    if (st) return st;
    if (s->len > c->size - c->pos)
        return moetax_error(MOETAX_ERR_FORMAT,
                            "%s: byte %llu: %s: string length %llu runs past the end of the file (%llu bytes left)",
                            c->path, (unsigned long long)at, field, (unsigned long long)s->len,
                            (unsigned long long)(c->size - c->pos));
    s->data = (const char *)c->base + c->pos;
    if (name) {
        if (s->len == 0)
            return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: %s: empty name", c->path,
                                (unsigned long long)at, field);
        if (!moetax_utf8_valid(s->data, s->len))
            return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: %s: name is not valid UTF-8 (or contains NUL)",
                                c->path, (unsigned long long)at, field);
    }
    c->pos += s->len;
    return MOETAX_OK;
}

/* Skip (and validate) one value of type t; depth bounds nested arrays. */
static moetax_status skip_value(struct cursor *c, uint32_t t, int depth, const char *field) {
    size_t sz = moetax_gguf_type_size((enum moetax_gguf_type)t);
    if (sz) {
        moetax_status st = need(c, sz, field);
        if (!st) c->pos += sz;
        return st;
    }
    if (t == MOETAX_GGUF_TYPE_STRING) {
        struct moetax_gguf_str s;
        return rd_str(c, &s, field, false);
    }
    if (t != MOETAX_GGUF_TYPE_ARRAY)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: %s: unknown value type %u (expected 0..12)",
                            c->path, (unsigned long long)(c->pos - 4), field, t);
    if (depth >= MAX_ARRAY_DEPTH)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: %s: arrays nested deeper than %d", c->path,
                            (unsigned long long)c->pos, field, MAX_ARRAY_DEPTH);
    uint32_t et;
    uint64_t n, at = c->pos;
    moetax_status st;
    if ((st = rd_u32(c, &et, field)) || (st = rd_u64(c, &n, field))) return st;
    if (et >= MOETAX_GGUF_TYPE_COUNT)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: %s: unknown array element type %u", c->path,
                            (unsigned long long)at, field, et);
    size_t esz = moetax_gguf_type_size((enum moetax_gguf_type)et);
    uint64_t min_each = esz ? esz : (et == MOETAX_GGUF_TYPE_STRING ? 8 : 12);
    if (n > (c->size - c->pos) / min_each)
        return moetax_error(MOETAX_ERR_FORMAT,
                            "%s: byte %llu: %s: array of %llu %s elements cannot fit in the %llu bytes left",
                            c->path, (unsigned long long)at, field, (unsigned long long)n,
                            moetax_gguf_type_name((enum moetax_gguf_type)et), (unsigned long long)(c->size - c->pos));
    if (esz) { c->pos += n * esz; return MOETAX_OK; }
    for (uint64_t i = 0; i < n; i++)
        if ((st = skip_value(c, et, depth + 1, field))) return st;
    return MOETAX_OK;
}

static moetax_status parse_kv(struct cursor *c, struct moetax_gguf_kv *kv, uint64_t idx) {
    char field[96];
    snprintf(field, sizeof field, "metadata key #%llu", (unsigned long long)idx);
    kv->file_offset = c->pos;
    moetax_status st = rd_str(c, &kv->key, field, true);
    if (st) return st;
    int kl = kv->key.len > 60 ? 60 : (int)kv->key.len;
    snprintf(field, sizeof field, "metadata '%.*s'", kl, kv->key.data);
    uint32_t t;
    if ((st = rd_u32(c, &t, field))) return st;
    if (t >= MOETAX_GGUF_TYPE_COUNT)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: %s: unknown value type %u (expected 0..12)",
                            c->path, (unsigned long long)(c->pos - 4), field, t);
    kv->type = (enum moetax_gguf_type)t;
    kv->value_offset = c->pos;
    const uint8_t *p = c->base + c->pos;
    switch (kv->type) {
    case MOETAX_GGUF_TYPE_STRING:
        if ((st = rd_str(c, &kv->v.str, field, false))) return st;
        break;
    case MOETAX_GGUF_TYPE_ARRAY: {
        uint64_t at = c->pos;
        if ((st = skip_value(c, MOETAX_GGUF_TYPE_ARRAY, 0, field))) return st;
        uint32_t et;
        memcpy(&et, p, 4);
        memcpy(&kv->arr_n, p + 4, 8);
        kv->arr_type = (enum moetax_gguf_type)et;
        kv->arr_data = p + 12;
        if (kv->arr_type == MOETAX_GGUF_TYPE_STRING && kv->arr_n) {
            struct moetax_gguf_str *strs = malloc(kv->arr_n * sizeof *strs);
            if (!strs)
                return moetax_error(MOETAX_ERR_NOMEM, "%s: byte %llu: %s: out of memory for %llu strings",
                                    c->path, (unsigned long long)at, field, (unsigned long long)kv->arr_n);
            struct cursor sc = *c;
            sc.pos = at + 12;
            for (uint64_t i = 0; i < kv->arr_n; i++) rd_str(&sc, &strs[i], field, false); /* validated above */
            kv->arr_str = strs;
        }
        break;
    }
    default: {
        size_t sz = moetax_gguf_type_size(kv->type);
        if ((st = need(c, sz, field))) return st;
        uint8_t b1; uint16_t b2; uint32_t b4; uint64_t b8; float f4; double f8;
        switch (kv->type) {
        case MOETAX_GGUF_TYPE_UINT8: memcpy(&b1, p, 1); kv->v.u64 = b1; break;
        case MOETAX_GGUF_TYPE_BOOL: memcpy(&b1, p, 1); kv->v.u64 = b1 != 0; break;
        case MOETAX_GGUF_TYPE_INT8: memcpy(&b1, p, 1); kv->v.i64 = (int8_t)b1; break;
        case MOETAX_GGUF_TYPE_UINT16: memcpy(&b2, p, 2); kv->v.u64 = b2; break;
        case MOETAX_GGUF_TYPE_INT16: memcpy(&b2, p, 2); kv->v.i64 = (int16_t)b2; break;
        case MOETAX_GGUF_TYPE_UINT32: memcpy(&b4, p, 4); kv->v.u64 = b4; break;
        case MOETAX_GGUF_TYPE_INT32: memcpy(&b4, p, 4); kv->v.i64 = (int32_t)b4; break;
        case MOETAX_GGUF_TYPE_UINT64: memcpy(&b8, p, 8); kv->v.u64 = b8; break;
        case MOETAX_GGUF_TYPE_INT64: memcpy(&b8, p, 8); kv->v.i64 = (int64_t)b8; break;
        case MOETAX_GGUF_TYPE_FLOAT32: memcpy(&f4, p, 4); kv->v.f64 = f4; break;
        case MOETAX_GGUF_TYPE_FLOAT64: memcpy(&f8, p, 8); kv->v.f64 = f8; break;
        default: break;
        }
        c->pos += sz;
    }
    }
    kv->value_size = c->pos - kv->value_offset;
    return MOETAX_OK;
}

static moetax_status parse_tensor_info(struct cursor *c, struct moetax_gguf_tensor *t, uint64_t idx) {
    char field[128];
    snprintf(field, sizeof field, "tensor info #%llu", (unsigned long long)idx);
    t->info_offset = c->pos;
    moetax_status st = rd_str(c, &t->name, field, true);
    if (st) return st;
    int nl = t->name.len > 64 ? 64 : (int)t->name.len;
    snprintf(field, sizeof field, "tensor '%.*s'", nl, t->name.data);
    if ((st = rd_u32(c, &t->n_dims, field))) return st;
    if (t->n_dims < 1 || t->n_dims > MOETAX_GGUF_MAX_DIMS)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: %s: n_dims %u (expected 1..%d)", c->path,
                            (unsigned long long)(c->pos - 4), field, t->n_dims, MOETAX_GGUF_MAX_DIMS);
    int64_t nel = 1;
    for (int d = 0; d < MOETAX_GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        uint64_t ne;
        uint64_t at = c->pos;
        if ((st = rd_u64(c, &ne, field))) return st;
        if (ne == 0 || ne > (uint64_t)INT64_MAX || __builtin_mul_overflow(nel, (int64_t)ne, &nel))
            return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: %s: dimension %u is %llu (expected >= 1 with a total that fits in 63 bits)",
                                c->path, (unsigned long long)at, field, d, (unsigned long long)ne);
        t->ne[d] = (int64_t)ne;
    }
    uint32_t type;
    if ((st = rd_u32(c, &type, field))) return st;
    if (!moetax_type_valid(type))
        return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: %s: unknown tensor type %u", c->path,
                            (unsigned long long)(c->pos - 4), field, type);
    t->type = (enum moetax_type)type;
    int64_t blck = moetax_type_blck_size(t->type);
    uint64_t nbytes = 0;
    enum moetax_nbytes_err e = moetax_tensor_nbytes(t->type, MOETAX_GGUF_MAX_DIMS, t->ne, &nbytes, NULL);
    if (e == MOETAX_NBYTES_NOT_BLOCKS)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: %s: first dimension %lld is not a multiple of the %s block size %lld",
                            c->path, field, (long long)t->ne[0], moetax_type_name(t->type), (long long)blck);
    if (e)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: %s: %s (%s, %lld x %lld x %lld x %lld)", c->path,
                            (unsigned long long)t->info_offset, field, moetax_nbytes_err_str(e),
                            moetax_type_name(t->type), (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                            (long long)t->ne[3]);
    t->nbytes = nbytes;
    if ((st = rd_u64(c, &t->offset, field))) return st;
    return MOETAX_OK;
}

static int cmp_tensor_offset(const void *a, const void *b) {
    const struct moetax_gguf_tensor *x = *(const struct moetax_gguf_tensor *const *)a;
    const struct moetax_gguf_tensor *y = *(const struct moetax_gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static moetax_status build_index(struct moetax_gguf *g) {
    struct name_index *ix = calloc(1, sizeof *ix);
    if (!ix) return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", g->path);
    g->index = ix;
    uint64_t n = g->n_kv > g->n_tensors ? g->n_kv : g->n_tensors;
    uint64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    ix->cap = cap;
    ix->kv_slot = malloc(cap * sizeof(int64_t));
    ix->t_slot = malloc(cap * sizeof(int64_t));
    if (!ix->kv_slot || !ix->t_slot) return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", g->path);
    memset(ix->kv_slot, 0xff, cap * sizeof(int64_t));
    memset(ix->t_slot, 0xff, cap * sizeof(int64_t));
    for (uint64_t i = 0; i < g->n_kv; i++) {
        struct moetax_gguf_str k = g->kv[i].key;
        uint64_t h = moetax_gguf_hash(k.data, k.len) & (cap - 1);
        while (ix->kv_slot[h] >= 0) {
            if (str_eq(g->kv[ix->kv_slot[h]].key, k.data, k.len))
                return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: metadata key '%.*s' appears twice", g->path,
                                    (unsigned long long)g->kv[i].file_offset, (int)(k.len > 80 ? 80 : k.len), k.data);
            h = (h + 1) & (cap - 1);
        }
        ix->kv_slot[h] = (int64_t)i;
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct moetax_gguf_str k = g->tensors[i].name;
        uint64_t h = moetax_gguf_hash(k.data, k.len) & (cap - 1);
        while (ix->t_slot[h] >= 0) {
            if (str_eq(g->tensors[ix->t_slot[h]].name, k.data, k.len))
                return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: tensor name '%.*s' appears twice", g->path,
                                    (unsigned long long)g->tensors[i].info_offset, (int)(k.len > 80 ? 80 : k.len), k.data);
            h = (h + 1) & (cap - 1);
        }
        ix->t_slot[h] = (int64_t)i;
    }
    return MOETAX_OK;
}

static moetax_status parse(struct moetax_gguf *g) {
    struct cursor c = {.base = g->base, .size = g->size, .pos = 0, .path = g->path};
    moetax_status st;
    char magic[4];
    if ((st = rd(&c, magic, 4, "magic"))) return st;
    if (memcmp(magic, "GGUF", 4) != 0)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: byte 0: magic is not \"GGUF\" (not a GGUF file)", g->path);
    if ((st = rd_u32(&c, &g->version, "version"))) return st;
    if (g->version != 2 && g->version != 3)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: byte 4: GGUF version %u is not supported (expected 2 or 3)",
                            g->path, g->version);
    if ((st = rd_u64(&c, &g->n_tensors, "tensor count")) || (st = rd_u64(&c, &g->n_kv, "metadata count")))
        return st;
    /* each key/value needs at least 8+1+4+1 bytes, each tensor info 8+1+4+8+4+8 */
    if (g->n_kv > (c.size - c.pos) / 14)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: byte 16: metadata count %llu cannot fit in a %llu-byte file",
                            g->path, (unsigned long long)g->n_kv, (unsigned long long)g->size);
    if (g->n_tensors > (c.size - c.pos) / 33)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: byte 8: tensor count %llu cannot fit in a %llu-byte file",
                            g->path, (unsigned long long)g->n_tensors, (unsigned long long)g->size);
    g->kv = calloc(g->n_kv ? g->n_kv : 1, sizeof *g->kv);
    g->tensors = calloc(g->n_tensors ? g->n_tensors : 1, sizeof *g->tensors);
    if (!g->kv || !g->tensors) return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", g->path);
    for (uint64_t i = 0; i < g->n_kv; i++)
        if ((st = parse_kv(&c, &g->kv[i], i))) return st;
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if ((st = parse_tensor_info(&c, &g->tensors[i], i))) return st;
    if ((st = build_index(g))) return st;

    g->alignment = MOETAX_GGUF_DEFAULT_ALIGNMENT;
    const struct moetax_gguf_kv *al = moetax_gguf_find_kv(g, "general.alignment");
    if (al) {
        if (al->type != MOETAX_GGUF_TYPE_UINT32 || al->v.u64 == 0 || (al->v.u64 & (al->v.u64 - 1)))
            return moetax_error(MOETAX_ERR_FORMAT,
                                "%s: byte %llu: general.alignment must be a uint32 power of two (got %s %llu)",
                                g->path, (unsigned long long)al->file_offset, moetax_gguf_type_name(al->type),
                                (unsigned long long)al->v.u64);
        g->alignment = (uint32_t)al->v.u64;
    }
    uint64_t a = g->alignment;
    g->data_offset = (c.pos + a - 1) / a * a;
    if (g->n_tensors == 0) return MOETAX_OK;
    if (g->data_offset > g->size)
        return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: the tensor data section starts past the end of the file",
                            g->path, (unsigned long long)g->data_offset);
    uint64_t data_size = g->size - g->data_offset;
    struct moetax_gguf_tensor **order = malloc(g->n_tensors * sizeof *order);
    if (!order) return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", g->path);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct moetax_gguf_tensor *t = &g->tensors[i];
        int nl = t->name.len > 64 ? 64 : (int)t->name.len;
        if (t->offset % a != 0) {
            free(order);
            return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: tensor '%.*s': data offset %llu is not a multiple of the alignment %llu",
                                g->path, (unsigned long long)t->info_offset, nl, t->name.data,
                                (unsigned long long)t->offset, (unsigned long long)a);
        }
        if (t->offset > data_size || t->nbytes > data_size - t->offset) {
            free(order);
            return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: tensor '%.*s': data [%llu, +%llu) runs past the end of the file (data section holds %llu bytes)",
                                g->path, (unsigned long long)t->info_offset, nl, t->name.data,
                                (unsigned long long)t->offset, (unsigned long long)t->nbytes,
                                (unsigned long long)data_size);
        }
        t->data = g->base + g->data_offset + t->offset;
        order[i] = t;
    }
    qsort(order, g->n_tensors, sizeof *order, cmp_tensor_offset);
    for (uint64_t i = 1; i < g->n_tensors; i++) {
        const struct moetax_gguf_tensor *p = order[i - 1], *t = order[i];
        if (p->offset + p->nbytes > t->offset) {
            int pl = p->name.len > 64 ? 64 : (int)p->name.len, tl = t->name.len > 64 ? 64 : (int)t->name.len;
            moetax_status e = moetax_error(MOETAX_ERR_FORMAT, "%s: tensors '%.*s' [%llu, +%llu) and '%.*s' [%llu, ...) overlap",
                                           g->path, pl, p->name.data, (unsigned long long)p->offset,
                                           (unsigned long long)p->nbytes, tl, t->name.data, (unsigned long long)t->offset);
            free(order);
            return e;
        }
    }
    free(order);
    return MOETAX_OK;
}

static moetax_status finish_open(struct moetax_gguf *g, struct moetax_gguf **out) {
    moetax_status st = parse(g);
    if (st) {
        moetax_gguf_close(g);
        return st;
    }
    *out = g;
    return MOETAX_OK;
}

moetax_status moetax_gguf_open(const char *path, struct moetax_gguf **out) {
    *out = NULL;
    if (!path) return moetax_error(MOETAX_ERR_ARG, "no file name given");
    struct moetax_gguf *g = calloc(1, sizeof *g);
    if (!g) return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", path);
    g->fd = -1;
    g->path = strdup(path);
    if (!g->path) { free(g); return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", path); }
    /* non-blocking: opening a FIFO (or a device) must not wait for a writer before
     * the regular-file check below; cleared again for the file's reads */
    g->fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (g->fd < 0) {
        moetax_status st = moetax_error(MOETAX_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        moetax_gguf_close(g);
        return st;
    }
    struct stat sb;
    if (fstat(g->fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        moetax_status st = moetax_error(MOETAX_ERR_IO, "%s: not a regular file (%s): a GGUF model must be a file", path,
                                        S_ISDIR(sb.st_mode) ? "a directory" : S_ISFIFO(sb.st_mode) ? "a FIFO"
                                        : S_ISCHR(sb.st_mode) || S_ISBLK(sb.st_mode) ? "a device"
                                        : S_ISSOCK(sb.st_mode) ? "a socket" : "not a file");
        moetax_gguf_close(g);
        return st;
    }
    int fl = fcntl(g->fd, F_GETFL);
    if (fl != -1) (void)fcntl(g->fd, F_SETFL, fl & ~O_NONBLOCK);
    g->size = (uint64_t)sb.st_size;
    if (g->size == 0) {
        moetax_status st = moetax_error(MOETAX_ERR_FORMAT, "%s: the file is empty (expected a GGUF header)", path);
        moetax_gguf_close(g);
        return st;
    }
    void *m = mmap(NULL, g->size, PROT_READ, MAP_PRIVATE, g->fd, 0);
    if (m == MAP_FAILED) {
        moetax_status st = moetax_error(MOETAX_ERR_IO, "%s: mmap of %llu bytes failed: %s", path,
                                        (unsigned long long)g->size, strerror(errno));
        moetax_gguf_close(g);
        return st;
    }
    g->base = m;
    g->mapped = true;
    moetax_gguf_sigbus_register(g); /* parsing reads the mapping too */
#ifdef MADV_HUGEPAGE
    /* Where the filesystem caches files in large folios (ext4 and xfs on recent
     * kernels), pages read from disk through this mapping come in as 2 MiB folios,
     * mapped whole: streaming weights through 4 KiB pages decoded 8-12% slower
     * (F16/F32, Zen 3). Pages already cached in smaller folios stay as they are
     * (see moetax_mem_pages and --no-mmap). Not for a file larger than the free
     * memory: its faults would read ahead 2 MiB at a time from a file that cannot
     * stay cached (such models want an expert store). Best effort. */
    long avail = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (avail > 0 && psz > 0 && (double)g->size < (double)avail * (double)psz) (void)madvise(m, g->size, MADV_HUGEPAGE);
#endif
    return finish_open(g, out);
}

moetax_status moetax_gguf_open_memory(const void *buf, size_t size, struct moetax_gguf **out) {
    *out = NULL;
    struct moetax_gguf *g = calloc(1, sizeof *g);
    if (!g) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    g->fd = -1;
    g->path = strdup("<memory>");
    g->base = buf;
    g->size = size;
    if (!g->path) { free(g); return moetax_error(MOETAX_ERR_NOMEM, "out of memory"); }
    return finish_open(g, out);
}

void moetax_gguf_close(struct moetax_gguf *g) {
    if (!g) return;
    if (g->kv)
        for (uint64_t i = 0; i < g->n_kv; i++) free((void *)g->kv[i].arr_str);
    free(g->kv);
    free(g->tensors);
    struct name_index *ix = g->index;
    if (ix) { free(ix->kv_slot); free(ix->t_slot); free(ix); }
    if (g->mapped) {
        moetax_gguf_sigbus_unregister(g);
        munmap((void *)g->base, g->size);
    }
    if (g->fd >= 0) close(g->fd);
    free(g->path);
    free(g);
}

const struct moetax_gguf_kv *moetax_gguf_find_kv(const struct moetax_gguf *g, const char *key) {
    const struct name_index *ix = g->index;
    if (!ix || !key) return NULL;
    uint64_t n = strlen(key);
    for (uint64_t h = moetax_gguf_hash(key, n) & (ix->cap - 1); ix->kv_slot[h] >= 0; h = (h + 1) & (ix->cap - 1))
        if (str_eq(g->kv[ix->kv_slot[h]].key, key, n)) return &g->kv[ix->kv_slot[h]];
    return NULL;
}

const struct moetax_gguf_tensor *moetax_gguf_find_tensor(const struct moetax_gguf *g, const char *name) {
    const struct name_index *ix = g->index;
    if (!ix || !name) return NULL;
    uint64_t n = strlen(name);
    for (uint64_t h = moetax_gguf_hash(name, n) & (ix->cap - 1); ix->t_slot[h] >= 0; h = (h + 1) & (ix->cap - 1))
        if (str_eq(g->tensors[ix->t_slot[h]].name, name, n)) return &g->tensors[ix->t_slot[h]];
    return NULL;
}

int64_t moetax_gguf_tensor_nelements(const struct moetax_gguf_tensor *t) {
    return t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
}

/* ---- typed getters ------------------------------------------------------------ */

static bool is_unsigned(enum moetax_gguf_type t) {
    return t == MOETAX_GGUF_TYPE_UINT8 || t == MOETAX_GGUF_TYPE_UINT16 || t == MOETAX_GGUF_TYPE_UINT32 ||
           t == MOETAX_GGUF_TYPE_UINT64 || t == MOETAX_GGUF_TYPE_BOOL;
}
static bool is_signed(enum moetax_gguf_type t) {
    return t == MOETAX_GGUF_TYPE_INT8 || t == MOETAX_GGUF_TYPE_INT16 || t == MOETAX_GGUF_TYPE_INT32 ||
           t == MOETAX_GGUF_TYPE_INT64;
}

static moetax_status lookup(const struct moetax_gguf *g, const char *key, const struct moetax_gguf_kv **kv) {
    *kv = moetax_gguf_find_kv(g, key);
    if (!*kv) return moetax_error(MOETAX_ERR_NOT_FOUND, "%s: metadata key '%s' is missing", g->path, key);
    return MOETAX_OK;
}

static moetax_status bad_type(const struct moetax_gguf *g, const struct moetax_gguf_kv *kv, const char *want) {
    return moetax_error(MOETAX_ERR_FORMAT, "%s: byte %llu: metadata '%.*s' is %s, expected %s", g->path,
                        (unsigned long long)kv->file_offset, (int)(kv->key.len > 80 ? 80 : kv->key.len),
                        kv->key.data, moetax_gguf_type_name(kv->type), want);
}

moetax_status moetax_gguf_get_i64(const struct moetax_gguf *g, const char *key, int64_t *out) {
    const struct moetax_gguf_kv *kv;
    moetax_status st = lookup(g, key, &kv);
    if (st) return st;
    if (is_signed(kv->type)) { *out = kv->v.i64; return MOETAX_OK; }
    if (is_unsigned(kv->type) && kv->v.u64 <= (uint64_t)INT64_MAX) { *out = (int64_t)kv->v.u64; return MOETAX_OK; }
    return bad_type(g, kv, "an integer that fits in int64");
}

moetax_status moetax_gguf_get_u64(const struct moetax_gguf *g, const char *key, uint64_t *out) {
    const struct moetax_gguf_kv *kv;
    moetax_status st = lookup(g, key, &kv);
    if (st) return st;
    if (is_unsigned(kv->type)) { *out = kv->v.u64; return MOETAX_OK; }
    if (is_signed(kv->type) && kv->v.i64 >= 0) { *out = (uint64_t)kv->v.i64; return MOETAX_OK; }
    return bad_type(g, kv, "a non-negative integer");
}

moetax_status moetax_gguf_get_u32(const struct moetax_gguf *g, const char *key, uint32_t *out) {
    uint64_t v;
    moetax_status st = moetax_gguf_get_u64(g, key, &v);
    if (st) return st;
    if (v > UINT32_MAX) return bad_type(g, moetax_gguf_find_kv(g, key), "an integer that fits in uint32");
    *out = (uint32_t)v;
    return MOETAX_OK;
}

moetax_status moetax_gguf_get_f32(const struct moetax_gguf *g, const char *key, float *out) {
    const struct moetax_gguf_kv *kv;
    moetax_status st = lookup(g, key, &kv);
    if (st) return st;
    if (kv->type == MOETAX_GGUF_TYPE_FLOAT32 || kv->type == MOETAX_GGUF_TYPE_FLOAT64) *out = (float)kv->v.f64;
    else if (is_signed(kv->type)) *out = (float)kv->v.i64;
    else if (is_unsigned(kv->type) && kv->type != MOETAX_GGUF_TYPE_BOOL) *out = (float)kv->v.u64;
    else return bad_type(g, kv, "a number");
    return MOETAX_OK;
}

moetax_status moetax_gguf_get_bool(const struct moetax_gguf *g, const char *key, bool *out) {
    const struct moetax_gguf_kv *kv;
    moetax_status st = lookup(g, key, &kv);
    if (st) return st;
    if (kv->type == MOETAX_GGUF_TYPE_BOOL || is_unsigned(kv->type)) *out = kv->v.u64 != 0;
    else if (is_signed(kv->type)) *out = kv->v.i64 != 0;
    else return bad_type(g, kv, "a bool");
    return MOETAX_OK;
}

moetax_status moetax_gguf_get_str(const struct moetax_gguf *g, const char *key, char *buf, size_t cap) {
    const struct moetax_gguf_kv *kv;
    moetax_status st = lookup(g, key, &kv);
    if (st) return st;
    if (kv->type != MOETAX_GGUF_TYPE_STRING) return bad_type(g, kv, "a string");
    if (kv->v.str.len >= cap || memchr(kv->v.str.data, 0, kv->v.str.len))
        return moetax_error(MOETAX_ERR_FORMAT, "%s: metadata '%s': string of %llu bytes is too long (max %zu) or contains NUL",
                            g->path, key, (unsigned long long)kv->v.str.len, cap ? cap - 1 : 0);
    memcpy(buf, kv->v.str.data, kv->v.str.len);
    buf[kv->v.str.len] = 0;
    return MOETAX_OK;
}

moetax_status moetax_gguf_get_arr(const struct moetax_gguf *g, const char *key, enum moetax_gguf_type *type,
                                  uint64_t *n) {
    const struct moetax_gguf_kv *kv;
    moetax_status st = lookup(g, key, &kv);
    if (st) return st;
    if (kv->type != MOETAX_GGUF_TYPE_ARRAY) return bad_type(g, kv, "an array");
    *type = kv->arr_type;
    *n = kv->arr_n;
    return MOETAX_OK;
}

bool moetax_gguf_arr_i64(const struct moetax_gguf_kv *kv, uint64_t i, int64_t *out) {
    if (kv->type != MOETAX_GGUF_TYPE_ARRAY || i >= kv->arr_n) return false;
    const uint8_t *p = (const uint8_t *)kv->arr_data + i * moetax_gguf_type_size(kv->arr_type);
    uint8_t b1; uint16_t b2; uint32_t b4; uint64_t b8;
    switch (kv->arr_type) {
    case MOETAX_GGUF_TYPE_UINT8: case MOETAX_GGUF_TYPE_BOOL: memcpy(&b1, p, 1); *out = b1; return true;
    case MOETAX_GGUF_TYPE_INT8: memcpy(&b1, p, 1); *out = (int8_t)b1; return true;
    case MOETAX_GGUF_TYPE_UINT16: memcpy(&b2, p, 2); *out = b2; return true;
    case MOETAX_GGUF_TYPE_INT16: memcpy(&b2, p, 2); *out = (int16_t)b2; return true;
    case MOETAX_GGUF_TYPE_UINT32: memcpy(&b4, p, 4); *out = b4; return true;
    case MOETAX_GGUF_TYPE_INT32: memcpy(&b4, p, 4); *out = (int32_t)b4; return true;
    case MOETAX_GGUF_TYPE_UINT64: memcpy(&b8, p, 8); if (b8 > (uint64_t)INT64_MAX) return false; *out = (int64_t)b8; return true;
    case MOETAX_GGUF_TYPE_INT64: memcpy(&b8, p, 8); *out = (int64_t)b8; return true;
    default: return false;
    }
}

bool moetax_gguf_arr_f64(const struct moetax_gguf_kv *kv, uint64_t i, double *out) {
    if (kv->type != MOETAX_GGUF_TYPE_ARRAY || i >= kv->arr_n) return false;
    const uint8_t *p = (const uint8_t *)kv->arr_data + i * moetax_gguf_type_size(kv->arr_type);
    if (kv->arr_type == MOETAX_GGUF_TYPE_FLOAT32) { float f; memcpy(&f, p, 4); *out = f; return true; }
    if (kv->arr_type == MOETAX_GGUF_TYPE_FLOAT64) { memcpy(out, p, 8); return true; }
    int64_t v;
    if (!moetax_gguf_arr_i64(kv, i, &v)) return false;
    *out = (double)v;
    return true;
}
