/*
 * moetax/status.h - named status codes and the last-error message.
 *
 * DESIGN
 *   Library code never exits or aborts on anything a file, a user or the network
 *   can cause. Every fallible function returns a moetax_status; on failure it
 *   also leaves a human-readable message (file, byte offset or field, and what
 *   was expected) in a thread-local buffer read with moetax_last_error().
 *
 * INVARIANTS
 *   - MOETAX_OK is 0; every error is non-zero.
 *   - moetax_error() returns its status argument so callers can write
 *       return moetax_error(MOETAX_ERR_FORMAT, "%s: offset %llu: ...", ...);
 *   - MOETAX_ASSERT is for internal invariants only (a bug in moetax), never
 *     for input validation.
 */
#ifndef MOETAX_STATUS_H
#define MOETAX_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum moetax_status {
    MOETAX_OK = 0,
    MOETAX_ERR_IO,          /* open/read/write/mmap failed */
    MOETAX_ERR_FORMAT,      /* file content is malformed */
    MOETAX_ERR_NOMEM,       /* allocation failed */
    MOETAX_ERR_ARG,         /* invalid argument or option */
    MOETAX_ERR_UNSUPPORTED, /* valid but not supported (type, architecture) */
    MOETAX_ERR_NOT_FOUND,   /* key or tensor missing */
    MOETAX_ERR_SHAPE,       /* tensor shape does not match the metadata */
    MOETAX_ERR_LIMIT,       /* a configured limit would be exceeded (KV cache, budget) */
    MOETAX_ERR_NUMERIC,     /* a result is not finite (NaN or inf): a broken model or input */
    MOETAX_ERR_INTERNAL,    /* bug */
} moetax_status;

/* Stable name of a status, e.g. "MOETAX_ERR_FORMAT". */
const char *moetax_status_name(moetax_status st);

/* Record a formatted message for the calling thread and return st. */
moetax_status moetax_error(moetax_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* The last message recorded on this thread ("" if none). */
const char *moetax_last_error(void);

/* Clear the last message. */
void moetax_clear_error(void);

/* Internal invariant check: prints file:line and aborts. Not for input checks. */
void moetax_assert_fail(const char *file, int line, const char *expr);
#define MOETAX_ASSERT(x) \
    do { if (!(x)) moetax_assert_fail(__FILE__, __LINE__, #x); } while (0)

#ifdef __cplusplus
}
#endif
#endif
