/* bench.h - the parts of `moetax bench`, one file each. */
#ifndef MOETAX_TOOLS_BENCH_H
#define MOETAX_TOOLS_BENCH_H

int bench_mem_main(int argc, char **argv);     /* bench_mem.c: read bandwidth, barrier round trip */
int bench_kernels_main(int argc, char **argv); /* bench_kernels.c: kernel GB/s vs roofline */
int bench_model_main(int argc, char **argv);
int bench_io_main(int argc, char **argv);      /* bench_io.c: read GB/s per request size and queue depth */   /* bench_model.c: prefill/decode like llama-bench */

#endif
