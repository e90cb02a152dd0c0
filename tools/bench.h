/* bench.h - the parts of `moetax bench`, one file each. */
#ifndef MOETAX_TOOLS_BENCH_H
#define MOETAX_TOOLS_BENCH_H

int bench_mem_main(int argc, char **argv);     /* bench_mem.c: read bandwidth, barrier round trip */
int bench_kernels_main(int argc, char **argv); /* bench_kernels.c: kernel GB/s vs roofline */
int bench_model_main(int argc, char **argv);
int bench_io_main(int argc, char **argv);      /* bench_io.c: read GB/s per request size and queue depth */
/* Random (or sequential) read GB/s of a file with `qd` reader threads of `req`-byte requests
 * for about `seconds`, O_DIRECT unless buffered; -1 on failure. The reference the expert
 * store's read bandwidth is compared with. */
#include <stdbool.h>
#include <stdint.h>
double bench_io_measure(const char *file, uint64_t req, int qd, bool random, bool buffered, double seconds);   /* bench_model.c: prefill/decode like llama-bench */


/* bench_batch.c: B sequences decoding together (--batch LIST) */
#include "moetax/model.h"
struct moetax_pool;
struct cli_ledger_opts;
struct bench_batch_opts {
    int64_t batch[16];
    int n_batch;
    int64_t n_prompt, n_gen, reps;
    bool json, no_mmap;
    enum moetax_type kv_type;
    enum moetax_type expert_type; /* --expert-type (moetax_model_params) */
    int experts_used;
    float capacity_factor;
    enum moetax_overflow overflow;
    const struct cli_ledger_opts *lo; /* --ledger / --trace: one ledger for every B */
    const int32_t *text;              /* -f TEXT: the sequences' tokens (NULL: pseudo-random ids) */
    int64_t n_text;
};
/* bench_model.c: the tokens of a text file with the model's tokenizer (-f). */
moetax_status bench_text_tokens(const char *model, const char *path, int32_t **out, int64_t *n);
moetax_status bench_batch_run(const char *path, struct moetax_pool *pool, double read_gbps,
                              const struct bench_batch_opts *o);

#endif
