/* fuzz_model.c - libFuzzer target past the GGUF layer: any input that parses as
 * GGUF goes on through the model loader (moetax_model_load_memory: hyper-parameter
 * rules, block count, every tensor's shape and type, aligned copies of tensors at
 * odd offsets, norms converted and checked), the tokenizer (load, encode, decode)
 * and, for what loads, a context and two steps: a prompt of three tokens (with a
 * second sequence's token beside it) and one decode step, on one thread, with the
 * hidden states checked for NaN / inf (random weights may give them: an error, as
 * a user gets it), in F32, F16 or Q8_0 KV cells by the input's size. Every input must load and run or fail with a status and a
 * message; never crash, leak or read out of bounds. Built with -DMOETAX_FUZZ=ON
 * (clang); scripts/test.sh runs it briefly from a seed corpus of small generated
 * models, and the CTest fuzz_model_long (label slow) for longer. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "moetax/model.h"
#include "moetax/pool.h"
#include "moetax/tokenizer.h"

/* A failed call must leave a message (the trap makes libFuzzer report the input). */
static void must_say(moetax_status st) {
    if (st != MOETAX_OK && moetax_last_error()[0] == 0) __builtin_trap();
    moetax_clear_error();
}

/* Two steps of the loaded model: three prompt tokens of sequence 0 and one of sequence 1,
 * then one token of sequence 0; every logit row read. */
static void run_steps(const struct moetax_model *m, enum moetax_type kv_type) {
    static struct moetax_pool *pool;
    if (!pool) {
        struct moetax_pool_params pp = {.n_threads = 1};
        if (moetax_pool_init(&pp, &pool) != MOETAX_OK) __builtin_trap();
    }
    struct moetax_ctx_params cp = {.n_ctx = 16, .n_seq_max = 2, .kv_block = 8, .n_ubatch = 4, .pool = pool,
                                   .check_finite = true, .kv_type = kv_type};
    struct moetax_ctx *c = NULL;
    moetax_status st = moetax_ctx_init(m, &cp, &c);
    must_say(st);
    if (st != MOETAX_OK) return;
    struct moetax_batch b;
    if (moetax_batch_init(&b, 4) != MOETAX_OK) __builtin_trap();
    const int32_t V = m->hp.n_vocab;
    const int32_t toks[4] = {0, V - 1, V / 2, V > 1 ? 1 : 0};
    for (int i = 0; i < 3; i++) moetax_batch_add(&b, toks[i], i, 0, i == 2);
    moetax_batch_add(&b, toks[3], 0, 1, true);
    st = moetax_ctx_decode(c, &b);
    must_say(st);
    if (st == MOETAX_OK) {
        volatile float sink = moetax_ctx_logits_ith(c, 2)[V - 1] + moetax_ctx_logits_ith(c, 3)[0];
        (void)sink;
        moetax_batch_clear(&b);
        moetax_batch_add(&b, toks[1], 3, 0, true);
        must_say(moetax_ctx_decode(c, &b));
    }
    moetax_batch_free(&b);
    moetax_ctx_free(c);
}

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
    moetax_clear_error();
    static const enum moetax_type cells[3] = {MOETAX_TYPE_F32, MOETAX_TYPE_F16, MOETAX_TYPE_Q8_0};
    run_steps(m, cells[size % 3]);
    moetax_model_free(m);
    moetax_clear_error();
    return 0;
}
