/*
 * printable.h - bytes from a file or a client made safe to show: on a terminal, in an error message, in
 * an HTML page. A control byte (below 0x20) or DEL (0x7f) could move the cursor, clear the screen or
 * retitle the window, so each becomes '?', and so do both bytes of a C1 control's UTF-8 form
 * (U+0080..U+009F, 0xc2 0x80..0x9f: U+009B is CSI to some terminals); with MOETAX_PRINTABLE_ASCII every
 * byte from 0x80 becomes '?' (a binary file's bytes; names from JSON, valid UTF-8, keep the rest).
 *
 * INVARIANTS
 *   - dst is always NUL-terminated (dst_size >= 1) and holds at most dst_size - 1 bytes.
 *   - The copy stops at src_len bytes, at a NUL in src, or when dst is full; the return value is
 *     the number of bytes of src taken, so src[ret] (when ret < src_len) says whether some were cut.
 *   - dst may be src (made printable in place).
 */
#ifndef MOETAX_CORE_PRINTABLE_H
#define MOETAX_CORE_PRINTABLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum { MOETAX_PRINTABLE_ASCII = 1 }; /* bytes from 0x80 become '?' too */

/* A C0 control byte or DEL. */
static inline bool moetax_is_control(unsigned char c) { return c < 0x20 || c == 0x7f; }

/* src[0..src_len) (SIZE_MAX: a C string) into dst[dst_size], each byte the flags do not keep as '?'. */
size_t moetax_printable(char *dst, size_t dst_size, const char *src, size_t src_len, unsigned flags);

#endif
