/*
 * moetax/readfile.h - a whole input in memory, within a byte limit: the placement map, the tools'
 * text inputs (prompt and text files, configurations), report's input (a ledger, trace or profile)
 * and routing profiles (moetax_profile_load: --warm, --ep-load) are read through here. Not yet: tune's
 * log, with its own bounded line reader.
 *
 * DESIGN
 *   The input is read to its end, or to one byte past max_bytes: a regular file, a FIFO, a device or
 *   standard input (the stream variant). A device such as /dev/zero never ends, so the limit is what
 *   stops it; the size a file claims is not trusted (a FIFO has none, a file may grow). A directory
 *   is refused by name before anything is read. With .text, a NUL byte is an error naming its line
 *   and byte offset, and the read stops at the chunk that holds it (/dev/zero fails at once).
 *
 * INVARIANTS
 *   - On MOETAX_OK *buf is malloc'd with *len bytes and a NUL after them ((*buf)[*len] == 0; an empty
 *     input is "" and 0). With .text the bytes hold no NUL, so *buf is the whole text as a C string.
 *   - On an error *buf is NULL, *len is 0, and the message (moetax_last_error) starts with the
 *     input's name: MOETAX_ERR_IO cannot open or read it (with the system's reason), MOETAX_ERR_ARG
 *     a directory, MOETAX_ERR_LIMIT more than max_bytes (a caller may say it again with the option
 *     that raises its limit), MOETAX_ERR_FORMAT a NUL byte in text, MOETAX_ERR_NOMEM.
 *   - A stream is neither opened nor closed here.
 */
#ifndef MOETAX_READFILE_H
#define MOETAX_READFILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "moetax/status.h"

#ifdef __cplusplus
extern "C" {
#endif

struct moetax_readfile_params {
    size_t max_bytes; /* more is MOETAX_ERR_LIMIT; 0: no limit but memory */
    bool text;        /* a NUL byte is MOETAX_ERR_FORMAT (see moetax_readfile_check_text) */
    const char *name; /* what the messages call the input, e.g. "--placement map.txt" (NULL: the path;
                       * for a stream, "standard input") */
};

/* The whole file at path; p may be NULL (no limit, any bytes, named by the path). */
moetax_status moetax_readfile_path(const char *path, const struct moetax_readfile_params *p, char **buf,
                                   size_t *len);
/* The same from an open stream (stdin for "-"), read from where it stands to its end. */
moetax_status moetax_readfile_stream(FILE *f, const struct moetax_readfile_params *p, char **buf, size_t *len);
/* MOETAX_OK when text[0..len) holds no NUL byte; else MOETAX_ERR_FORMAT naming name, the line and the
 * byte offset of the first: for text that is then used as a C string (a NUL would cut it). */
moetax_status moetax_readfile_check_text(const char *name, const char *text, size_t len);

#ifdef __cplusplus
}
#endif
#endif
