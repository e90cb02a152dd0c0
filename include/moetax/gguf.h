/*
 * moetax/gguf.h - GGUF v3 reader (mmap, bounds-checked) and streaming writer.
 *
 * FILE FORMAT (little-endian)
 *   magic "GGUF" | u32 version (3; 2 is accepted) | u64 n_tensors | u64 n_kv
 *   n_kv x { string key | u32 value_type | value }
 *     string = u64 length + bytes (no terminator)
 *     array  = u32 element_type + u64 count + count elements (nested arrays allowed)
 *   n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 type | u64 offset }
 *   padding to general.alignment (u32, default 32, a power of two)
 *   tensor data; each tensor's offset is relative to the start of this section
 *   and is a multiple of the alignment.
 *
 * INVARIANTS (after moetax_gguf_open returns MOETAX_OK)
 *   - Every string, array, tensor and the data section lie inside the file;
 *     all arithmetic on counts and sizes is overflow-checked.
 *   - Keys and tensor names are unique, non-empty, valid UTF-8 without NUL.
 *   - Every tensor has 1..4 dims, ne[i] >= 1, a known type, ne[0] a multiple of
 *     the type's block size, an aligned offset, and does not overlap another.
 *   - Pointers returned (strings, array data, tensor data) point into the
 *     mapping and stay valid until moetax_gguf_close. Strings are NOT
 *     NUL-terminated: use the length.
 *
 * WRITER
 *   Metadata and tensor infos are collected in memory (small), then the data is
 *   streamed tensor by tensor in declaration order; the file is written to
 *   "<path>.tmp" and renamed on success, so a failed write never leaves a
 *   truncated file under the final name. Output is deterministic.
 */
#ifndef MOETAX_GGUF_H
#define MOETAX_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moetax/status.h"
#include "moetax/types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOETAX_GGUF_DEFAULT_ALIGNMENT 32
#define MOETAX_GGUF_MAX_DIMS 4

enum moetax_gguf_type {
    MOETAX_GGUF_TYPE_UINT8 = 0,
    MOETAX_GGUF_TYPE_INT8 = 1,
    MOETAX_GGUF_TYPE_UINT16 = 2,
    MOETAX_GGUF_TYPE_INT16 = 3,
    MOETAX_GGUF_TYPE_UINT32 = 4,
    MOETAX_GGUF_TYPE_INT32 = 5,
    MOETAX_GGUF_TYPE_FLOAT32 = 6,
    MOETAX_GGUF_TYPE_BOOL = 7,
    MOETAX_GGUF_TYPE_STRING = 8,
    MOETAX_GGUF_TYPE_ARRAY = 9,
    MOETAX_GGUF_TYPE_UINT64 = 10,
    MOETAX_GGUF_TYPE_INT64 = 11,
    MOETAX_GGUF_TYPE_FLOAT64 = 12,
    MOETAX_GGUF_TYPE_COUNT = 13,
};

const char *moetax_gguf_type_name(enum moetax_gguf_type t);
/* Size of a scalar value type, 0 for string/array. */
size_t moetax_gguf_type_size(enum moetax_gguf_type t);

struct moetax_gguf_str {
    uint64_t len;
    const char *data; /* into the mapping, not NUL-terminated */
};

struct moetax_gguf_kv {
    struct moetax_gguf_str key;
    enum moetax_gguf_type type;
    uint64_t file_offset;  /* byte offset of the key in the file (for messages) */
    uint64_t value_offset; /* byte offset of the value (after the type field) */
    uint64_t value_size;   /* bytes of the serialized value (arrays: incl. type and count) */
    union {
        uint64_t u64; /* UINT8..UINT64 and BOOL widened */
        int64_t i64;  /* INT8..INT64 sign-extended */
        double f64;   /* FLOAT32/FLOAT64 widened */
        struct moetax_gguf_str str;
    } v;
    /* arrays */
    enum moetax_gguf_type arr_type;
    uint64_t arr_n;
    const void *arr_data;               /* scalar elements, into the mapping (unaligned) */
    const struct moetax_gguf_str *arr_str; /* string elements (allocated) */
};

struct moetax_gguf_tensor {
    struct moetax_gguf_str name;
    uint32_t n_dims;
    int64_t ne[MOETAX_GGUF_MAX_DIMS]; /* ggml order: ne[0] fastest; unused dims are 1 */
    enum moetax_type type;
    uint64_t offset;      /* relative to the data section */
    uint64_t nbytes;
    const void *data;     /* into the mapping */
    uint64_t info_offset; /* byte offset of the tensor info in the file (for messages) */
};

struct moetax_gguf {
    char *path;           /* copy of the path (or "<memory>") */
    uint32_t version;
    uint64_t n_kv;
    struct moetax_gguf_kv *kv;
    uint64_t n_tensors;
    struct moetax_gguf_tensor *tensors;
    uint32_t alignment;
    uint64_t data_offset; /* file offset of the data section */
    const uint8_t *base;  /* mapping */
    uint64_t size;        /* file size */
    int fd;               /* -1 for memory */
    bool mapped;
    void *index;          /* internal name index */
};

/* Open and validate a file. On error returns a status, *out is NULL and
 * moetax_last_error() names the file, the byte offset and the field. */
moetax_status moetax_gguf_open(const char *path, struct moetax_gguf **out);
/* Parse a buffer (not copied; must outlive the handle). For tests and fuzzing. */
moetax_status moetax_gguf_open_memory(const void *buf, size_t size, struct moetax_gguf **out);
void moetax_gguf_close(struct moetax_gguf *g);

/* SIGBUS on a mapped file (src/gguf/gguf_sigbus.c). A file truncated while it is
 * mapped makes reads past its new end raise SIGBUS. Every open file's mapping is
 * registered; after moetax_gguf_sigbus_install (process-wide, idempotent; the
 * library never installs it by itself, the CLI does at start), a SIGBUS in a
 * registered mapping writes one line to stderr naming the file, the tensor and
 * the byte offset, and ends the process with _exit(MOETAX_GGUF_SIGBUS_EXIT):
 * the one thing a signal handler can do there (the read cannot be resumed).
 * An embedder that must survive such a file should copy it instead of mapping
 * it. Any other SIGBUS goes to the previous handler or the default action. */
#define MOETAX_GGUF_SIGBUS_EXIT 75
moetax_status moetax_gguf_sigbus_install(void);

/* Lookups; NULL if absent. Keys compared as byte strings. */
const struct moetax_gguf_kv *moetax_gguf_find_kv(const struct moetax_gguf *g, const char *key);
const struct moetax_gguf_tensor *moetax_gguf_find_tensor(const struct moetax_gguf *g, const char *name);

/* Typed getters. Return MOETAX_ERR_NOT_FOUND if absent, MOETAX_ERR_FORMAT if
 * the stored type cannot represent the request (e.g. negative into u32);
 * integers of any width convert when the value fits. */
moetax_status moetax_gguf_get_u32(const struct moetax_gguf *g, const char *key, uint32_t *out);
moetax_status moetax_gguf_get_u64(const struct moetax_gguf *g, const char *key, uint64_t *out);
moetax_status moetax_gguf_get_i64(const struct moetax_gguf *g, const char *key, int64_t *out);
moetax_status moetax_gguf_get_f32(const struct moetax_gguf *g, const char *key, float *out);
moetax_status moetax_gguf_get_bool(const struct moetax_gguf *g, const char *key, bool *out);
/* String value copied into buf (NUL-terminated); FORMAT if it does not fit. */
moetax_status moetax_gguf_get_str(const struct moetax_gguf *g, const char *key, char *buf, size_t cap);
/* Array of any type: element type and count. */
moetax_status moetax_gguf_get_arr(const struct moetax_gguf *g, const char *key,
                                  enum moetax_gguf_type *type, uint64_t *n);
/* Scalar element i of a numeric array, converted. */
bool moetax_gguf_arr_f64(const struct moetax_gguf_kv *kv, uint64_t i, double *out);
bool moetax_gguf_arr_i64(const struct moetax_gguf_kv *kv, uint64_t i, int64_t *out);

/* Number of values in a tensor. */
int64_t moetax_gguf_tensor_nelements(const struct moetax_gguf_tensor *t);

/* ---- writer ----------------------------------------------------------------- */
struct moetax_gguf_writer;

moetax_status moetax_gguf_writer_init(const char *path, struct moetax_gguf_writer **out);
/* Discards the temporary file unless finish succeeded. */
void moetax_gguf_writer_free(struct moetax_gguf_writer *w);

moetax_status moetax_gguf_writer_set_alignment(struct moetax_gguf_writer *w, uint32_t alignment);
moetax_status moetax_gguf_writer_set_u8(struct moetax_gguf_writer *w, const char *key, uint8_t v);
moetax_status moetax_gguf_writer_set_i8(struct moetax_gguf_writer *w, const char *key, int8_t v);
moetax_status moetax_gguf_writer_set_u16(struct moetax_gguf_writer *w, const char *key, uint16_t v);
moetax_status moetax_gguf_writer_set_i16(struct moetax_gguf_writer *w, const char *key, int16_t v);
moetax_status moetax_gguf_writer_set_u32(struct moetax_gguf_writer *w, const char *key, uint32_t v);
moetax_status moetax_gguf_writer_set_i32(struct moetax_gguf_writer *w, const char *key, int32_t v);
moetax_status moetax_gguf_writer_set_u64(struct moetax_gguf_writer *w, const char *key, uint64_t v);
moetax_status moetax_gguf_writer_set_i64(struct moetax_gguf_writer *w, const char *key, int64_t v);
moetax_status moetax_gguf_writer_set_f32(struct moetax_gguf_writer *w, const char *key, float v);
moetax_status moetax_gguf_writer_set_f64(struct moetax_gguf_writer *w, const char *key, double v);
moetax_status moetax_gguf_writer_set_bool(struct moetax_gguf_writer *w, const char *key, bool v);
moetax_status moetax_gguf_writer_set_str(struct moetax_gguf_writer *w, const char *key, const char *v);
/* Array of n scalars of type t (elements packed little-endian in data). */
moetax_status moetax_gguf_writer_set_arr(struct moetax_gguf_writer *w, const char *key,
                                         enum moetax_gguf_type t, const void *data, uint64_t n);
moetax_status moetax_gguf_writer_set_arr_str(struct moetax_gguf_writer *w, const char *key,
                                             const char *const *strs, uint64_t n);
/* Copy one key/value (any type, including nested arrays) from an open file. */
moetax_status moetax_gguf_writer_copy_kv(struct moetax_gguf_writer *w, const struct moetax_gguf *g,
                                         const struct moetax_gguf_kv *kv);

/* Declare a tensor; data must later be written in declaration order. */
moetax_status moetax_gguf_writer_add_tensor(struct moetax_gguf_writer *w, const char *name,
                                            enum moetax_type type, uint32_t n_dims, const int64_t *ne);
/* Append bytes of tensor data (any chunking; tensor boundaries and padding are
 * handled from the declared sizes). Writes the header on first call. */
moetax_status moetax_gguf_writer_write(struct moetax_gguf_writer *w, const void *data, size_t n);
/* Bytes of tensor data declared in total, and written so far. */
uint64_t moetax_gguf_writer_data_total(const struct moetax_gguf_writer *w);
uint64_t moetax_gguf_writer_data_written(const struct moetax_gguf_writer *w);
/* Check every tensor was written in full, flush, fsync and rename into place. */
moetax_status moetax_gguf_writer_finish(struct moetax_gguf_writer *w);

#ifdef __cplusplus
}
#endif
#endif
