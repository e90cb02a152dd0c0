/* readfile.c - a whole input in memory within a byte limit (see moetax/readfile.h). */
#include "moetax/readfile.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define READFILE_FIRST_CHUNK ((size_t)64 << 10) /* the first buffer; it doubles as the input goes on */
#define READFILE_NO_LIMIT (SIZE_MAX / 2)         /* max_bytes 0: memory is the limit (max + 1 cannot wrap) */

/* the NUL byte at text[off]: its 1-based line and offset */
static moetax_status nul_error(const char *name, const char *text, size_t off) {
    size_t line = 1;
    for (const char *q = text; (q = memchr(q, '\n', (size_t)(text + off - q))); q++) line++;
    return moetax_error(MOETAX_ERR_FORMAT, "%s:%zu: a NUL byte at byte offset %zu, on line %zu: a text file may not "
                        "contain NUL bytes", name, line, off, line);
}

moetax_status moetax_readfile_check_text(const char *name, const char *text, size_t len) {
    const char *nul = memchr(text, 0, len);
    return nul ? nul_error(name, text, (size_t)(nul - text)) : MOETAX_OK;
}

static moetax_status read_stream(FILE *f, const char *name, const struct moetax_readfile_params *p, char **buf,
                                 size_t *len) {
    *buf = NULL;
    *len = 0;
    const size_t max = p && p->max_bytes && p->max_bytes < READFILE_NO_LIMIT ? p->max_bytes : READFILE_NO_LIMIT;
    const bool text = p && p->text;
    struct stat sb;
    if (fstat(fileno(f), &sb) == 0 && S_ISDIR(sb.st_mode))
        return moetax_error(MOETAX_ERR_ARG, "%s: is a directory, not a file", name);
    size_t cap = max < READFILE_FIRST_CHUNK ? max + 1 : READFILE_FIRST_CHUNK, n = 0; /* one byte past max tells */
    char *b = malloc(cap + 1);                                                        /* + 1: the NUL after */
    if (!b) return moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory", name);
    moetax_status st = MOETAX_OK;
    for (;;) {
        if (n == cap) {
            const size_t grown = cap <= (max + 1) / 2 ? cap * 2 : max + 1;
            char *nb = realloc(b, grown + 1);
            if (!nb) { st = moetax_error(MOETAX_ERR_NOMEM, "%s: out of memory (%zu bytes read)", name, n); break; }
            b = nb;
            cap = grown;
        }
        const size_t want = cap - n, r = fread(b + n, 1, want, f);
        const int err = errno;
        const char *nul = text ? memchr(b + n, 0, r) : NULL;
        n += r;
        if (nul) { st = nul_error(name, b, (size_t)(nul - b)); break; }
        if (n > max) { st = moetax_error(MOETAX_ERR_LIMIT, "%s: more than %zu bytes", name, max); break; }
        if (r < want) { /* fread stops short only at the end or on an error */
            if (ferror(f)) st = moetax_error(MOETAX_ERR_IO, "%s: cannot read it: %s", name, strerror(err));
            break;
        }
    }
    if (st) {
        free(b);
        return st;
    }
    b[n] = 0;
    *buf = b;
    *len = n;
    return MOETAX_OK;
}

moetax_status moetax_readfile_stream(FILE *f, const struct moetax_readfile_params *p, char **buf, size_t *len) {
    return read_stream(f, p && p->name ? p->name : "standard input", p, buf, len);
}

moetax_status moetax_readfile_path(const char *path, const struct moetax_readfile_params *p, char **buf,
                                   size_t *len) {
    *buf = NULL;
    *len = 0;
    const char *name = p && p->name ? p->name : path;
    FILE *f = fopen(path, "rb");
    if (!f) return moetax_error(MOETAX_ERR_IO, "%s: cannot open it: %s", name, strerror(errno));
    const moetax_status st = read_stream(f, name, p, buf, len);
    fclose(f);
    return st;
}
