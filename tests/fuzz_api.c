/* fuzz_api.c - libFuzzer target for the server's request side: any body must
 * parse as an OpenAI completion / chat request or give a 400 with a message,
 * never crash, leak or overread; a parsed chat request renders in every known
 * template; any bytes go through the UTF-8 sanitizer into valid UTF-8.
 * Built with -DMOETAX_FUZZ=ON (clang); scripts/test.sh runs it briefly from a
 * seed corpus of request bodies. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/api.h"
#include "server/chat_template.h"

static bool valid_utf8(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        const unsigned char c = s[i];
        size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!k || i + k > n) return false;
        for (size_t j = 1; j < k; j++)
            if ((s[i + j] & 0xc0) != 0x80) return false;
        i += k;
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *body = (const char *)data;
    char err[256];
    for (int chat = 0; chat < 2; chat++) {
        struct srv_api_req r;
        memset(&r, 0, sizeof r);
        if (srv_api_parse(body, size, chat, &r, err, sizeof err) == 0) {
            if (chat)
                for (int t = 1; t < SRV_CHAT_COUNT; t++) {
                    size_t len = 0;
                    char *p = srv_chat_render((enum srv_chat_tmpl)t, r.msgs, r.n_msgs, true, &len);
                    if (p && strlen(p) != len) __builtin_trap();
                    free(p);
                }
            srv_api_req_free(&r);
        } else if (!err[0]) {
            __builtin_trap(); /* a refusal always says why */
        }
    }
    size_t n = 0;
    char *s = srv_utf8_sanitize(body, size, &n);
    if (s && !valid_utf8((const unsigned char *)s, n)) __builtin_trap();
    free(s);
    return 0;
}
