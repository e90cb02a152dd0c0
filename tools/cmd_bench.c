/* cmd_bench.c - `moetax bench [mem|kernels] ...`; without a mode, benchmarks a model. */
#include <stdio.h>
#include <string.h>

#include "bench.h"
#include "commands.h"

static void usage(FILE *f) {
    fprintf(f, "usage: moetax bench mem [options]       read bandwidth of this machine (the roofline)\n"
               "       moetax bench kernels [options]   kernel GB/s and ratio to the roofline\n"
               "       moetax bench io [options]        O_DIRECT read GB/s per request size and queue depth\n"
               "       moetax bench -m FILE [options]   model prefill/decode (like llama-bench)\n"
               "each mode takes --help\n");
}

int cmd_bench(int argc, char **argv) {
    if (argc < 2) { usage(stderr); return 2; }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "mem")) return bench_mem_main(argc - 1, argv + 1);
    if (!strcmp(argv[1], "kernels")) return bench_kernels_main(argc - 1, argv + 1);
    if (!strcmp(argv[1], "io")) return bench_io_main(argc - 1, argv + 1);
    return bench_model_main(argc, argv);
}
