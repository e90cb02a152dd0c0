/* fuzz_gguf.c - libFuzzer target for the GGUF reader: any input must parse or
 * fail with a named status and a message; never crash, leak or overread.
 * Built with -DMOETAX_FUZZ=ON (clang); scripts/test.sh runs it briefly from a
 * seed corpus of generated files. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "moetax/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct moetax_gguf *g = NULL;
    moetax_status st = moetax_gguf_open_memory(data, size, &g);
    if (st == MOETAX_OK) {
        /* touch what a loader touches */
        volatile uint64_t sink = 0;
        for (uint64_t i = 0; i < g->n_kv; i++) {
            const struct moetax_gguf_kv *kv = &g->kv[i];
            if (kv->type == MOETAX_GGUF_TYPE_ARRAY && kv->arr_str)
                for (uint64_t j = 0; j < kv->arr_n; j++) sink += kv->arr_str[j].len ? (uint8_t)kv->arr_str[j].data[0] : 0;
            int64_t v;
            double d;
            if (kv->type == MOETAX_GGUF_TYPE_ARRAY && kv->arr_n) {
                moetax_gguf_arr_i64(kv, kv->arr_n - 1, &v);
                moetax_gguf_arr_f64(kv, kv->arr_n - 1, &d);
            }
        }
        for (uint64_t i = 0; i < g->n_tensors; i++) {
            const struct moetax_gguf_tensor *t = &g->tensors[i];
            if (t->nbytes) sink += ((const uint8_t *)t->data)[0] + ((const uint8_t *)t->data)[t->nbytes - 1];
            char name[128];
            size_t n = t->name.len < sizeof name - 1 ? t->name.len : sizeof name - 1;
            memcpy(name, t->name.data, n);
            name[n] = 0;
            if (moetax_gguf_find_tensor(g, name) == NULL && t->name.len < sizeof name - 1) __builtin_trap();
        }
        (void)sink;
        moetax_gguf_close(g);
    } else if (moetax_last_error()[0] == 0) {
        __builtin_trap(); /* every error must leave a message */
    }
    moetax_clear_error();
    return 0;
}
