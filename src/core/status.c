/* status.c - status names and the thread-local last-error buffer. */
#include "moetax/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local char g_last_error[1024];

const char *moetax_status_name(moetax_status st) {
    switch (st) {
    case MOETAX_OK: return "MOETAX_OK";
    case MOETAX_ERR_IO: return "MOETAX_ERR_IO";
    case MOETAX_ERR_FORMAT: return "MOETAX_ERR_FORMAT";
    case MOETAX_ERR_NOMEM: return "MOETAX_ERR_NOMEM";
    case MOETAX_ERR_ARG: return "MOETAX_ERR_ARG";
    case MOETAX_ERR_UNSUPPORTED: return "MOETAX_ERR_UNSUPPORTED";
    case MOETAX_ERR_NOT_FOUND: return "MOETAX_ERR_NOT_FOUND";
    case MOETAX_ERR_SHAPE: return "MOETAX_ERR_SHAPE";
    case MOETAX_ERR_LIMIT: return "MOETAX_ERR_LIMIT";
    case MOETAX_ERR_NUMERIC: return "MOETAX_ERR_NUMERIC";
    case MOETAX_ERR_INTERNAL: return "MOETAX_ERR_INTERNAL";
    }
    return "MOETAX_ERR_UNKNOWN";
}

moetax_status moetax_error(moetax_status st, const char *fmt, ...) {
    /* formatted aside first: an argument may be moetax_last_error() itself (a message that wraps the
     * one before it), which vsnprintf into the same buffer would overwrite while reading it */
    char msg[sizeof g_last_error];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    memcpy(g_last_error, msg, sizeof msg);
    return st;
}

const char *moetax_last_error(void) { return g_last_error; }

void moetax_clear_error(void) { g_last_error[0] = '\0'; }

void moetax_assert_fail(const char *file, int line, const char *expr) {
    fprintf(stderr, "moetax: internal error at %s:%d: assertion failed: %s\n", file, line, expr);
    fflush(stderr);
    abort();
}
