/*
 * gguf_write.c - streaming GGUF writer.
 *
 * Metadata is serialized into an in-memory buffer as it is set (a few MB at
 * most, e.g. a vocabulary); tensor infos are kept in an array. The header is
 * written on the first data write; tensor data is then streamed in declaration
 * order with zero padding to the alignment after each tensor. Everything goes
 * to a temporary file next to <path> (moetax/outfile.h: symbolic links followed,
 * only regular files replaced), renamed over it only by a successful finish.
 */
#include "moetax/gguf.h"
#include "moetax/outfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf/gguf_impl.h"

struct wtensor {
    char *name;
    enum moetax_type type;
    uint32_t n_dims;
    int64_t ne[MOETAX_GGUF_MAX_DIMS];
    uint64_t nbytes;
    uint64_t offset;
};

struct moetax_gguf_writer {
    char *path;
    const char *tmp_path; /* owned by out */
    struct moetax_outfile *out;
    FILE *f;
    char *fbuf;
    uint32_t alignment;
    /* metadata, serialized */
    uint8_t *kv_buf;
    size_t kv_len, kv_cap;
    uint64_t n_kv;
    char **keys;
    size_t n_keys, cap_keys;
    /* tensors */
    struct wtensor *t;
    size_t n_t, cap_t;
    /* streaming state */
    bool header_written;
    bool failed;
    bool finished;
    size_t cur;           /* tensor being written */
    uint64_t cur_written; /* bytes of it written */
    uint64_t data_total, data_written;
};

static moetax_status werr_io(struct moetax_gguf_writer *w, const char *what) {
    w->failed = true;
    return moetax_error(MOETAX_ERR_IO, "%s: %s of %s failed: %s (the temporary file is removed, %s left as it was)",
                        w->path, what, w->tmp_path, strerror(errno), w->path);
}

moetax_status moetax_gguf_writer_init(const char *path, struct moetax_gguf_writer **out) {
    *out = NULL;
    if (!path || !*path) return moetax_error(MOETAX_ERR_ARG, "gguf writer: no output path");
    struct moetax_gguf_writer *w = calloc(1, sizeof *w);
    if (!w) return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", path);
    w->alignment = MOETAX_GGUF_DEFAULT_ALIGNMENT;
    w->path = strdup(path);
    if (!w->path) {
        moetax_gguf_writer_free(w);
        return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", path);
    }
    moetax_status st = moetax_outfile_open(path, &w->out);
    if (st) {
        moetax_gguf_writer_free(w);
        return st;
    }
    w->f = moetax_outfile_file(w->out);
    w->tmp_path = moetax_outfile_tmp_path(w->out);
    w->fbuf = malloc(1 << 20);
    if (w->fbuf) setvbuf(w->f, w->fbuf, _IOFBF, 1 << 20);
    *out = w;
    return MOETAX_OK;
}

void moetax_gguf_writer_free(struct moetax_gguf_writer *w) {
    if (!w) return;
    moetax_outfile_abort(w->out); /* NULL once committed */
    free(w->fbuf);
    free(w->kv_buf);
    for (size_t i = 0; i < w->n_keys; i++) free(w->keys[i]);
    free(w->keys);
    for (size_t i = 0; i < w->n_t; i++) free(w->t[i].name);
    free(w->t);
    free(w->path);
    free(w);
}

static moetax_status kv_put(struct moetax_gguf_writer *w, const void *p, size_t n) {
    if (n == 0) return MOETAX_OK;
    if (w->kv_len + n > w->kv_cap) {
        size_t cap = w->kv_cap ? w->kv_cap : 4096;
        while (cap < w->kv_len + n) cap *= 2;
        uint8_t *b = realloc(w->kv_buf, cap);
        if (!b) { w->failed = true; return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory for metadata", w->path); }
        w->kv_buf = b;
        w->kv_cap = cap;
    }
    memcpy(w->kv_buf + w->kv_len, p, n);
    w->kv_len += n;
    return MOETAX_OK;
}

static moetax_status kv_put_str(struct moetax_gguf_writer *w, const char *s, uint64_t n) {
    moetax_status st = kv_put(w, &n, 8);
    return st ? st : kv_put(w, s, n);
}

static moetax_status kv_begin(struct moetax_gguf_writer *w, const char *key, enum moetax_gguf_type t) {
    if (w->failed) return moetax_error(MOETAX_ERR_ARG, "%s: writer is in a failed state", w->path);
    if (w->header_written)
        return moetax_error(MOETAX_ERR_ARG, "%s: metadata '%s' set after tensor data started", w->path, key);
    size_t kl = key ? strlen(key) : 0;
    if (!kl || !moetax_utf8_valid(key, kl))
        return moetax_error(MOETAX_ERR_ARG, "%s: invalid metadata key", w->path);
    for (size_t i = 0; i < w->n_keys; i++)
        if (!strcmp(w->keys[i], key)) return moetax_error(MOETAX_ERR_ARG, "%s: metadata key '%s' set twice", w->path, key);
    if (w->n_keys == w->cap_keys) {
        size_t cap = w->cap_keys ? 2 * w->cap_keys : 64;
        char **k = realloc(w->keys, cap * sizeof *k);
        if (!k) return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", w->path);
        w->keys = k;
        w->cap_keys = cap;
    }
    if (!(w->keys[w->n_keys] = strdup(key))) return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", w->path);
    w->n_keys++;
    w->n_kv++;
    uint32_t tt = (uint32_t)t;
    moetax_status st = kv_put_str(w, key, kl);
    return st ? st : kv_put(w, &tt, 4);
}

static moetax_status set_scalar(struct moetax_gguf_writer *w, const char *key, enum moetax_gguf_type t, const void *v) {
    moetax_status st = kv_begin(w, key, t);
    return st ? st : kv_put(w, v, moetax_gguf_type_size(t));
}

moetax_status moetax_gguf_writer_set_u8(struct moetax_gguf_writer *w, const char *k, uint8_t v) { return set_scalar(w, k, MOETAX_GGUF_TYPE_UINT8, &v); }
moetax_status moetax_gguf_writer_set_i8(struct moetax_gguf_writer *w, const char *k, int8_t v) { return set_scalar(w, k, MOETAX_GGUF_TYPE_INT8, &v); }
moetax_status moetax_gguf_writer_set_u16(struct moetax_gguf_writer *w, const char *k, uint16_t v) { return set_scalar(w, k, MOETAX_GGUF_TYPE_UINT16, &v); }
moetax_status moetax_gguf_writer_set_i16(struct moetax_gguf_writer *w, const char *k, int16_t v) { return set_scalar(w, k, MOETAX_GGUF_TYPE_INT16, &v); }
moetax_status moetax_gguf_writer_set_u32(struct moetax_gguf_writer *w, const char *k, uint32_t v) { return set_scalar(w, k, MOETAX_GGUF_TYPE_UINT32, &v); }
moetax_status moetax_gguf_writer_set_i32(struct moetax_gguf_writer *w, const char *k, int32_t v) { return set_scalar(w, k, MOETAX_GGUF_TYPE_INT32, &v); }
moetax_status moetax_gguf_writer_set_u64(struct moetax_gguf_writer *w, const char *k, uint64_t v) { return set_scalar(w, k, MOETAX_GGUF_TYPE_UINT64, &v); }
moetax_status moetax_gguf_writer_set_i64(struct moetax_gguf_writer *w, const char *k, int64_t v) { return set_scalar(w, k, MOETAX_GGUF_TYPE_INT64, &v); }
moetax_status moetax_gguf_writer_set_f32(struct moetax_gguf_writer *w, const char *k, float v) { return set_scalar(w, k, MOETAX_GGUF_TYPE_FLOAT32, &v); }
moetax_status moetax_gguf_writer_set_f64(struct moetax_gguf_writer *w, const char *k, double v) { return set_scalar(w, k, MOETAX_GGUF_TYPE_FLOAT64, &v); }
moetax_status moetax_gguf_writer_set_bool(struct moetax_gguf_writer *w, const char *k, bool v) {
    uint8_t b = v ? 1 : 0;
    return set_scalar(w, k, MOETAX_GGUF_TYPE_BOOL, &b);
}

moetax_status moetax_gguf_writer_set_str(struct moetax_gguf_writer *w, const char *key, const char *v) {
    moetax_status st = kv_begin(w, key, MOETAX_GGUF_TYPE_STRING);
    return st ? st : kv_put_str(w, v, strlen(v));
}

moetax_status moetax_gguf_writer_set_arr(struct moetax_gguf_writer *w, const char *key, enum moetax_gguf_type t,
                                         const void *data, uint64_t n) {
    size_t es = moetax_gguf_type_size(t);
    if (!es) return moetax_error(MOETAX_ERR_ARG, "%s: array '%s': element type %s is not a scalar", w->path, key,
                                 moetax_gguf_type_name(t));
    moetax_status st = kv_begin(w, key, MOETAX_GGUF_TYPE_ARRAY);
    uint32_t tt = (uint32_t)t;
    if (!st) st = kv_put(w, &tt, 4);
    if (!st) st = kv_put(w, &n, 8);
    if (!st) st = kv_put(w, data, es * n);
    return st;
}

moetax_status moetax_gguf_writer_set_arr_str(struct moetax_gguf_writer *w, const char *key, const char *const *strs,
                                             uint64_t n) {
    moetax_status st = kv_begin(w, key, MOETAX_GGUF_TYPE_ARRAY);
    uint32_t tt = MOETAX_GGUF_TYPE_STRING;
    if (!st) st = kv_put(w, &tt, 4);
    if (!st) st = kv_put(w, &n, 8);
    for (uint64_t i = 0; !st && i < n; i++) st = kv_put_str(w, strs[i], strlen(strs[i]));
    return st;
}

moetax_status moetax_gguf_writer_copy_kv(struct moetax_gguf_writer *w, const struct moetax_gguf *g,
                                         const struct moetax_gguf_kv *kv) {
    char key[1024];
    if (kv->key.len >= sizeof key) return moetax_error(MOETAX_ERR_ARG, "%s: key too long to copy", w->path);
    memcpy(key, kv->key.data, kv->key.len);
    key[kv->key.len] = 0;
    if (!strcmp(key, "general.alignment")) return moetax_gguf_writer_set_alignment(w, (uint32_t)kv->v.u64);
    moetax_status st = kv_begin(w, key, kv->type);
    return st ? st : kv_put(w, g->base + kv->value_offset, kv->value_size);
}

moetax_status moetax_gguf_writer_set_alignment(struct moetax_gguf_writer *w, uint32_t alignment) {
    if (!alignment || (alignment & (alignment - 1)))
        return moetax_error(MOETAX_ERR_ARG, "%s: alignment %u is not a power of two", w->path, alignment);
    moetax_status st = moetax_gguf_writer_set_u32(w, "general.alignment", alignment);
    if (!st) w->alignment = alignment;
    return st;
}

moetax_status moetax_gguf_writer_add_tensor(struct moetax_gguf_writer *w, const char *name, enum moetax_type type,
                                            uint32_t n_dims, const int64_t *ne) {
    if (w->header_written)
        return moetax_error(MOETAX_ERR_ARG, "%s: tensor '%s' declared after data started", w->path, name);
    size_t nl = name ? strlen(name) : 0;
    if (!nl || !moetax_utf8_valid(name, nl)) return moetax_error(MOETAX_ERR_ARG, "%s: invalid tensor name", w->path);
    if (n_dims < 1 || n_dims > MOETAX_GGUF_MAX_DIMS)
        return moetax_error(MOETAX_ERR_ARG, "%s: tensor '%s': n_dims %u", w->path, name, n_dims);
    if (!moetax_type_valid((uint32_t)type))
        return moetax_error(MOETAX_ERR_ARG, "%s: tensor '%s': unknown type %d", w->path, name, (int)type);
    for (size_t i = 0; i < w->n_t; i++)
        if (!strcmp(w->t[i].name, name)) return moetax_error(MOETAX_ERR_ARG, "%s: tensor '%s' declared twice", w->path, name);
    struct wtensor t = {.type = type, .n_dims = n_dims};
    for (int d = 0; d < MOETAX_GGUF_MAX_DIMS; d++) t.ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] < 1) return moetax_error(MOETAX_ERR_ARG, "%s: tensor '%s': dim %u is %lld", w->path, name, d, (long long)ne[d]);
        t.ne[d] = ne[d];
    }
    int64_t blck = moetax_type_blck_size(type);
    enum moetax_nbytes_err e = moetax_tensor_nbytes(type, MOETAX_GGUF_MAX_DIMS, t.ne, &t.nbytes, NULL);
    if (e == MOETAX_NBYTES_NOT_BLOCKS)
        return moetax_error(MOETAX_ERR_ARG, "%s: tensor '%s': first dim %lld not a multiple of the %s block size %lld",
                            w->path, name, (long long)t.ne[0], moetax_type_name(type), (long long)blck);
    if (e) return moetax_error(MOETAX_ERR_ARG, "%s: tensor '%s': %s", w->path, name, moetax_nbytes_err_str(e));
    uint64_t a = w->alignment;
    t.offset = w->data_total;
    w->data_total += (t.nbytes + a - 1) / a * a;
    if (w->n_t == w->cap_t) {
        size_t cap = w->cap_t ? 2 * w->cap_t : 64;
        struct wtensor *nt = realloc(w->t, cap * sizeof *nt);
        if (!nt) return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", w->path);
        w->t = nt;
        w->cap_t = cap;
    }
    if (!(t.name = strdup(name))) return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", w->path);
    w->t[w->n_t++] = t;
    return MOETAX_OK;
}

static moetax_status put(struct moetax_gguf_writer *w, const void *p, size_t n) {
    if (n && fwrite(p, 1, n, w->f) != n) return werr_io(w, "write");
    return MOETAX_OK;
}

static moetax_status pad(struct moetax_gguf_writer *w, uint64_t pos) {
    static const uint8_t zeros[256];
    uint64_t a = w->alignment, n = (a - pos % a) % a;
    while (n) {
        size_t k = n > sizeof zeros ? sizeof zeros : (size_t)n;
        moetax_status st = put(w, zeros, k);
        if (st) return st;
        n -= k;
    }
    return MOETAX_OK;
}

static moetax_status write_header(struct moetax_gguf_writer *w) {
    uint32_t version = 3;
    uint64_t nt = w->n_t;
    uint64_t pos = 0;
    /* the whole file, checked against the free space before the first byte */
    uint64_t total = 24 + w->kv_len + w->data_total + w->alignment;
    for (size_t i = 0; i < w->n_t; i++) total += 8 + strlen(w->t[i].name) + 4 + 8ull * w->t[i].n_dims + 4 + 8;
    moetax_status st = moetax_outfile_reserve(w->out, total);
    if (st) { w->failed = true; return st; }
    st = put(w, "GGUF", 4);
    if (!st) st = put(w, &version, 4);
    if (!st) st = put(w, &nt, 8);
    if (!st) st = put(w, &w->n_kv, 8);
    if (!st) st = put(w, w->kv_buf, w->kv_len);
    pos = 24 + w->kv_len;
    for (size_t i = 0; !st && i < w->n_t; i++) {
        const struct wtensor *t = &w->t[i];
        uint64_t nl = strlen(t->name);
        uint32_t type = (uint32_t)t->type;
        st = put(w, &nl, 8);
        if (!st) st = put(w, t->name, nl);
        if (!st) st = put(w, &t->n_dims, 4);
        for (uint32_t d = 0; !st && d < t->n_dims; d++) st = put(w, &t->ne[d], 8);
        if (!st) st = put(w, &type, 4);
        if (!st) st = put(w, &t->offset, 8);
        pos += 8 + nl + 4 + 8ull * t->n_dims + 4 + 8;
    }
    if (!st && w->n_t) st = pad(w, pos);
    w->header_written = true;
    return st;
}

moetax_status moetax_gguf_writer_write(struct moetax_gguf_writer *w, const void *data, size_t n) {
    if (w->failed) return moetax_error(MOETAX_ERR_ARG, "%s: writer is in a failed state", w->path);
    moetax_status st;
    if (!w->header_written && (st = write_header(w))) return st;
    const uint8_t *p = data;
    while (n) {
        if (w->cur >= w->n_t) {
            w->failed = true;
            return moetax_error(MOETAX_ERR_ARG, "%s: more tensor data written than declared", w->path);
        }
        struct wtensor *t = &w->t[w->cur];
        uint64_t left = t->nbytes - w->cur_written;
        size_t k = n < left ? n : (size_t)left;
        if ((st = put(w, p, k))) return st;
        p += k;
        n -= k;
        w->cur_written += k;
        w->data_written += k;
        if (w->cur_written == t->nbytes) {
            if ((st = pad(w, t->nbytes))) return st;
            w->cur++;
            w->cur_written = 0;
        }
    }
    return MOETAX_OK;
}

uint64_t moetax_gguf_writer_data_total(const struct moetax_gguf_writer *w) { return w->data_total; }
uint64_t moetax_gguf_writer_data_written(const struct moetax_gguf_writer *w) { return w->data_written; }

moetax_status moetax_gguf_writer_finish(struct moetax_gguf_writer *w) {
    if (w->failed) return moetax_error(MOETAX_ERR_ARG, "%s: writer is in a failed state", w->path);
    moetax_status st;
    if (!w->header_written && (st = write_header(w))) return st;
    /* zero-byte tensors cannot exist (dims >= 1), so cur == n_t means all written */
    if (w->cur != w->n_t) {
        w->failed = true;
        return moetax_error(MOETAX_ERR_ARG, "%s: tensor '%s' was declared but only %llu of its %llu bytes were written",
                            w->path, w->t[w->cur].name, (unsigned long long)w->cur_written,
                            (unsigned long long)w->t[w->cur].nbytes);
    }
    if (fflush(w->f) != 0) return werr_io(w, "flush");
    if (fsync(fileno(w->f)) != 0 && errno != EINVAL) return werr_io(w, "fsync");
    /* Drop the written (now clean) pages from the page cache: the write path caches them
     * in small folios, and a model mapped from those streams through 4 KiB pages (8-15%
     * slower decode measured on F16/F32). Read back through the loader's mapping, they
     * come in as 2 MiB folios. Costs one read from disk at the first load. Best effort. */
#ifdef POSIX_FADV_DONTNEED
    (void)posix_fadvise(fileno(w->f), 0, 0, POSIX_FADV_DONTNEED);
#endif
    struct moetax_outfile *o = w->out;
    w->out = NULL; /* commit frees it, and removes the temporary file on an error */
    w->f = NULL;
    w->tmp_path = NULL;
    if ((st = moetax_outfile_commit(o))) {
        w->failed = true;
        return st;
    }
    w->finished = true;
    return MOETAX_OK;
}
