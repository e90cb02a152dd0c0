/* bench_model.c - model prefill/decode benchmark (issue 4: not implemented yet). */
#include <stdio.h>
#include "bench.h"

int bench_model_main(int argc, char **argv) {
    (void)argc; (void)argv;
    fprintf(stderr, "moetax bench: model benchmarks need the forward pass, which is not built yet;\n"
                    "available now: 'moetax bench mem' and 'moetax bench kernels'\n");
    return 2;
}
