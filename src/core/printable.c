/* printable.c - bytes made safe to show (see printable.h). */
#include "core/printable.h"

size_t moetax_printable(char *dst, size_t dst_size, const char *src, size_t src_len, unsigned flags) {
    if (!dst_size) return 0;
    size_t k = 0;
    for (; k + 1 < dst_size && k < src_len && src[k]; k++) {
        const unsigned char c = (unsigned char)src[k];
        dst[k] = moetax_is_control(c) || (c >= 0x80 && (flags & MOETAX_PRINTABLE_ASCII)) ? '?' : (char)c;
    }
    dst[k] = 0;
    return k;
}
