/* bench_mem.c - `moetax bench mem`: read bandwidth per thread count (the
 * roofline every other figure is divided by) and the pool's barrier round trip. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "cli.h"
#include "moetax/membw.h"
#include "moetax/pool.h"

#define BENCH_MEM_MAX_T 64

static void usage(FILE *f) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    fprintf(f,
            "usage: moetax bench mem [options]\n"
            "Read bandwidth of this machine (median of repeats, GB/s = 1e9 B/s) over a buffer far\n"
            "larger than the last-level cache, the thread pool's barrier round trip, and an empty pool run\n"
            "(publish, wake-up, join: what `bench kernels`' expert case pays once per matrix).\n"
            "\n"
            "options:\n"
            "  -t, --threads LIST     thread counts, e.g. 1,2 (default: 1..%ld, the online CPUs)\n"
            "      --size-mib N       buffer size in MiB (default 1024)\n"
            "  -r, --reps N           timed passes per thread count, median reported (default 7)\n"
            "      --barrier-iters N  barriers (and empty runs) timed per thread count (default 20000)\n"
            "      --pin              pin worker i to CPU i\n"
            "      --json             one JSON object per line:\n"
            "                           {\"test\":\"mem_read\",\"threads\",\"bytes\",\"gbps\",...}\n"
            "                           {\"test\":\"barrier\",\"threads\",\"iters\",\"median_ns\"}\n"
            "                           {\"test\":\"pool_run\",\"threads\",\"iters\",\"median_ns\"}\n"
            "  -h, --help             this text\n",
            n > 0 ? n : 1);
}

int bench_mem_main(int argc, char **argv) {
    const char *cmd = "bench mem";
    int64_t threads[BENCH_MEM_MAX_T];
    int n_t = 0;
    int64_t size_mib = 1024, reps = 7, barrier_iters = 20000;
    bool json = false, pin = false;

    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        bool err = false;
        if (cli_flag(argv, i, "-h", "--help")) {
            usage(stdout);
            return 0;
        } else if (cli_opt(argc, argv, &i, "-t", "--threads", &v, &err)) {
            if (err) return 2;
            if ((n_t = cli_parse_threads(cmd, v, threads, BENCH_MEM_MAX_T)) < 0) return 2;
        } else if (cli_opt(argc, argv, &i, NULL, "--size-mib", &v, &err)) {
            if (err) return 2;
            if (!cli_parse_i64(v, &size_mib) || size_mib < 1 || size_mib > (1 << 20))
                return cli_usage_error(cmd, "bad --size-mib '%s'", v);
        } else if (cli_opt(argc, argv, &i, "-r", "--reps", &v, &err)) {
            if (err) return 2;
            if (!cli_parse_i64(v, &reps) || reps < 1 || reps > 100000)
                return cli_usage_error(cmd, "bad --reps '%s'", v);
        } else if (cli_opt(argc, argv, &i, NULL, "--barrier-iters", &v, &err)) {
            if (err) return 2;
            if (!cli_parse_i64(v, &barrier_iters) || barrier_iters < 1 || barrier_iters > 100000000)
                return cli_usage_error(cmd, "bad --barrier-iters '%s'", v);
        } else if (cli_flag(argv, i, NULL, "--pin")) {
            pin = true;
        } else if (cli_flag(argv, i, NULL, "--json")) {
            json = true;
        } else {
            return cli_usage_error(cmd, "unknown option '%s'", argv[i]);
        }
    }
    if (n_t == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        if (n < 1) n = 1;
        if (n > BENCH_MEM_MAX_T) n = BENCH_MEM_MAX_T;
        for (int k = 0; k < n; k++) threads[n_t++] = k + 1;
    }
    size_t bytes = (size_t)size_mib << 20;

    if (!json) {
        printf("read bandwidth: %lld MiB buffer, median of %lld passes (kernel %s)\n", (long long)size_mib,
               (long long)reps, moetax_membw_kernel_name());
        printf("%8s %12s %10s %10s %10s %16s %12s\n", "threads", "bytes", "GB/s", "min", "max", "barrier ns", "run ns");
    }
    cli_progress prog;
    cli_progress_init(&prog, "bench mem", (uint64_t)n_t);
    for (int k = 0; k < n_t; k++) {
        cli_progress_update(&prog, (uint64_t)k);
        struct moetax_pool *pool = NULL;
        struct moetax_pool_params pp = {.n_threads = (int)threads[k], .pin = pin};
        moetax_status st = moetax_pool_init(&pp, &pool);
        if (st != MOETAX_OK) return cli_fail(cmd, st);

        struct moetax_membw_result r;
        st = moetax_membw_read_ex(pool, bytes, (int)reps, &r);
        if (st != MOETAX_OK) {
            moetax_pool_free(pool);
            return cli_fail(cmd, st);
        }
        double bar_ns = 0, run_ns = 0;
        st = moetax_pool_bench_barrier(pool, (int)barrier_iters, &bar_ns);
        if (st == MOETAX_OK) st = moetax_pool_bench_run(pool, (int)barrier_iters, &run_ns);
        moetax_pool_free(pool);
        if (st != MOETAX_OK) return cli_fail(cmd, st);

        if (prog.enabled) fprintf(stderr, "\r\033[K");
        if (json) {
            printf("{\"test\":\"mem_read\",\"threads\":%d,\"bytes\":%zu,\"reps\":%d,\"kernel\":\"%s\","
                   "\"gbps\":%.3f,\"gbps_min\":%.3f,\"gbps_max\":%.3f}\n",
                   r.threads, r.bytes, r.reps, r.kernel, r.gbps_median, r.gbps_min, r.gbps_max);
            printf("{\"test\":\"barrier\",\"threads\":%d,\"iters\":%lld,\"median_ns\":%.1f}\n", r.threads,
                   (long long)barrier_iters, bar_ns);
            printf("{\"test\":\"pool_run\",\"threads\":%d,\"iters\":%lld,\"median_ns\":%.1f}\n", r.threads,
                   (long long)barrier_iters, run_ns);
        } else {
            printf("%8d %12zu %10.2f %10.2f %10.2f %16.0f %12.0f\n", r.threads, r.bytes, r.gbps_median, r.gbps_min,
                   r.gbps_max, bar_ns, run_ns);
        }
        fflush(stdout);
    }
    return 0;
}
