/* printable.c - bytes made safe to show (see printable.h). */
#include "core/printable.h"

size_t moetax_printable(char *dst, size_t dst_size, const char *src, size_t src_len, unsigned flags) {
    if (!dst_size) return 0;
    size_t k = 0;
    bool c1 = false; /* src[k] is the second byte of a C1 control's UTF-8 form */
    for (; k + 1 < dst_size && k < src_len && src[k]; k++) {
        const unsigned char c = (unsigned char)src[k];
        bool bad = c1 || moetax_is_control(c) || (c >= 0x80 && (flags & MOETAX_PRINTABLE_ASCII));
        c1 = false;
        if (!bad && c == 0xc2 && k + 1 < src_len) { /* U+0080..U+009F: some terminals take U+009B as CSI */
            const unsigned char n = (unsigned char)src[k + 1];
            bad = c1 = n >= 0x80 && n <= 0x9f;
        }
        dst[k] = bad ? '?' : (char)c;
    }
    dst[k] = 0;
    return k;
}
