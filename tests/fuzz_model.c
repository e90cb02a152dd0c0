/* fuzz_model.c - libFuzzer target past the GGUF layer: any input that parses as
 * GGUF goes on through the model loader (moetax_model_load_memory: hyper-parameter
 * rules, block count, every tensor's shape and type, aligned copies of tensors at
 * odd offsets, norms converted and checked) and the tokenizer (load, encode,
 * decode). Every input must load or fail with a status and a message; never crash,
 * leak or read out of bounds. Built with -DMOETAX_FUZZ=ON (clang); scripts/test.sh
 * runs it briefly from a seed corpus of small generated models, and the CTest
 * fuzz_model_long (label slow) for longer. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "moetax/model.h"
#include "moetax/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct moetax_model *m = NULL;
    moetax_status st = moetax_model_load_memory(data, size, NULL, &m);
    if (st != MOETAX_OK) {
        if (moetax_last_error()[0] == 0) __builtin_trap(); /* every error must leave a message */
        moetax_clear_error();
        return 0;
    }
    /* what a run reads first: the bound weights' first and last bytes, the norms */
    volatile float sink = m->output_norm[0] + m->output_norm[m->hp.n_embd - 1];
    volatile uint8_t b = ((const uint8_t *)m->tok_embd.data)[m->tok_embd.mat_bytes - 1];
    (void)sink;
    (void)b;
    struct moetax_tokenizer *tok = NULL;
    if (moetax_tokenizer_load(m->gguf, &tok) == MOETAX_OK) {
        static const char text[] = "def f(x):\n    return x + 1  # caf\xc3\xa9 \xe2\x82\xac";
        int32_t ids[256];
        int64_t n = 0;
        if (moetax_tokenizer_encode(tok, text, sizeof text - 1, true, ids, 256, &n) == MOETAX_OK) {
            char out[1024];
            size_t no = 0;
            moetax_tokenizer_decode(tok, ids, n, out, sizeof out, &no);
        }
        moetax_tokenizer_free(tok);
    } else if (moetax_last_error()[0] == 0) {
        __builtin_trap();
    }
    moetax_model_free(m);
    moetax_clear_error();
    return 0;
}
