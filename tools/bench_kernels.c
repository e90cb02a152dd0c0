/* bench_kernels.c - `moetax bench kernels`: matmul GB/s of weights streamed,
 * as a ratio of the read bandwidth (membw) measured in the same run with the
 * same pool, plus GFLOP/s for batched matmul.
 *
 * Cases, per weight type and thread count:
 *   matrix   one [rows, cols] matrix filling --size-mib (cols = --cols), x 1 vector
 *   expert   expert-sized matrices (--expert ROWSxCOLS, default DeepSeek-V2-Lite's
 *            1408x2048 gate/up projection, and its transpose, the down projection,
 *            where its rows hold whole blocks of the type) laid back to back through
 *            the whole buffer, one pool run per matrix (so the per-run
 *            synchronization is in the figure), x 1 vector
 *   group8   the same experts (the first shape), 8 per pool run (each worker does
 *            its share of all 8 back to back)
 *   batch    the matrix (a slice of it sized to ~2 GFLOP) x 2, 8 and 64 vectors (--batch LIST; 2 rows
 *            read the weights as decode does, and should take about its time per byte)
 * Times are medians of --reps timed runs after one warm-up. Each timed run is
 * paired with a plain streaming read (moetax_membw_sum, every worker its share)
 * of the same bytes of the same buffer just before it: `paired` is the median
 * of the per-pair ratios of the two, the kernel's share of what the memory
 * gave at that moment, which drifts much less than the ratio to a membw
 * figure taken once per case on a shared machine. Weights are in the
 * layout the engine hands to matmul: types the table reads repacked (Q4_0 and
 * Q8_0 with avx2 and avx512, kernels.h) are repacked once, before timing; bytes are counted as
 * stored (the repacked layout has the same size). The calls are the table's matmul_stream,
 * what a model larger than the last-level cache runs (kernels.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "bench.h"
#include "cli.h"
#include "moetax/kernels.h"
#include "moetax/membw.h"
#include "moetax/pool.h"
#include "moetax/types.h"

#define BK_MAX_T 64
#define BK_MAX_TYPES 8
#define BK_MAX_BATCH 64

static void usage(FILE *f) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    fprintf(f,
            "usage: moetax bench kernels [options]\n"
            "Matrix x vector GB/s (weights as stored, 1e9 B/s) and its ratio to the read bandwidth\n"
            "measured in the same run, on a large matrix and on expert-sized matrices; GFLOP/s for\n"
            "batches of 8 and 64 rows. Medians of repeats. Weights are laid out as the engine hands\n"
            "them to matmul (Q4_0/Q8_0 repacked once for the table, before timing; same bytes),\n"
            "through the table's entry for weights streamed from memory (matmul_stream).\n"
            "The table is the CPU's best (printed first); MOETAX_KERNELS=ref|avx2|avx512 chooses\n"
            "one, MOETAX_FORCE_REF=1 the scalar reference kernels.\n"
            "\n"
            "options:\n"
            "  -t, --threads LIST   thread counts, e.g. 1,2 (default: 1..%ld, the online CPUs)\n"
            "      --types LIST     weight types (default f32,f16,bf16,q8_0,q4_0)\n"
            "  -r, --reps N         timed runs per case, median reported (default 7)\n"
            "      --size-mib N     weight buffer in MiB (default 256)\n"
            "      --cols N         columns of the large matrix (default 4096)\n"
            "      --cases LIST     matrix,expert,group8,batch (default: all)\n"
            "      --expert RxC     the expert cases' matrix, rows x columns (default 1408x2048,\n"
            "                       DeepSeek-V2-Lite's gate/up projection; its transpose, the down\n"
            "                       projection, runs too where its rows hold whole blocks of the\n"
            "                       type; 256x1024 is the small preset's)\n"
            "      --batch LIST     batch rows of the batch case, 1..64 (default 2,8,64; a batch of 2 rows is\n"
            "                       bound by the memory as decode is, so its GB/s should be decode's)\n"
            "      --pin            pin worker i to CPU i\n"
            "      --json           one JSON object per line and case:\n"
            "                         {\"test\":\"kernel\",\"kernel\",\"type\",\"threads\",\"case\",\"rows\",\"cols\",\n"
            "                          \"batch\",\"mats\",\"bytes\",\"ms\",\"gbps\",\"membw_gbps\",\"roofline_ratio\",\n"
            "                          \"paired_ratio\",\"paired_ratio_raw\",\"paired_ratio_error\",\"gflops\"}\n"
            "                       roofline_ratio = gbps / membw_gbps (membw: 'bench mem' in the same run);\n"
            "                       paired_ratio = median over runs of the kernel's GB/s / a plain read's\n"
            "                       GB/s of the same bytes right before it (robust to a drifting machine);\n"
            "                       above 1.1 a measurement error: null, the value in paired_ratio_raw\n"
            "  -h, --help           this text\n",
            n > 0 ? n : 1);
}

/* ---- work split over the pool ---- */

struct mm_ctx {
    const struct moetax_kernels *k;
    enum moetax_type t;
    const uint8_t *w;  /* first matrix */
    size_t mat_stride; /* bytes between matrices */
    int n_mats;
    int64_t rows, cols;
    size_t row_bytes;
    const void *xq;
    int64_t n_batch;
    float *y; /* [n_mats][n_batch][rows] */
};

/* Thread ith's first row: splits at multiples of the kernels' row group (kernels.h, ROW RANGES). */
static int64_t split_rows(int64_t rows, int ith, int nth) {
    if (ith >= nth) return rows;
    return (rows * ith / nth) / MOETAX_KERNELS_ROW_GROUP * MOETAX_KERNELS_ROW_GROUP;
}

static void mm_fn(void *p, int ith, int nth) {
    const struct mm_ctx *c = p;
    const int64_t r0 = split_rows(c->rows, ith, nth), r1 = split_rows(c->rows, ith + 1, nth);
    for (int m = 0; m < c->n_mats; m++)
        c->k->matmul_stream(c->t, c->w + (size_t)m * c->mat_stride, c->row_bytes, r0, r1, c->cols, c->xq, c->n_batch,
                     c->y + (size_t)m * (size_t)(c->n_batch * c->rows), c->rows);
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct pass_times {
    double secs;   /* median kernel pass */
    double paired; /* median over passes of (read time / kernel time) for the same bytes */
};

/* n_runs pool runs, each over n_mats matrices starting mat_stride * n_mats
 * apart, reading `bytes` bytes of weights from base.w: one warm-up pass, then
 * reps timed passes, each right after a timed plain read of the same bytes. */
static struct pass_times time_pass(struct moetax_pool *pool, struct mm_ctx base, int64_t n_runs, int reps,
                                   size_t bytes) {
    double *t = malloc(sizeof(double) * (size_t)reps), *r = malloc(sizeof(double) * (size_t)reps);
    for (int rep = -1; rep < reps; rep++) {
        double gbps = 0;
        if (moetax_membw_pass(pool, base.w, bytes, &gbps) == MOETAX_OK) /* the same bytes, plainly streamed */
            gbps = cli_read_pass_gbps(gbps);
        const double tr = (double)bytes / (gbps * 1e9);
        const double t0 = cli_now();
        for (int64_t i = 0; i < n_runs; i++) {
            struct mm_ctx c = base;
            c.w = base.w + (size_t)i * (size_t)base.n_mats * base.mat_stride;
            moetax_pool_run(pool, mm_fn, &c);
        }
        if (rep >= 0) {
            t[rep] = cli_now() - t0;
            r[rep] = tr / t[rep];
        }
    }
    struct pass_times pt = {.secs = median(t, reps), .paired = median(r, reps)};
    free(t), free(r);
    return pt;
}

struct bk_out {
    bool json;
    const char *kernel;
    bool paired_bad; /* a printed paired ratio was a measurement error (cli_paired_note) */
};

static void report(struct bk_out *o, enum moetax_type t, int threads, const char *cs, int64_t rows,
                   int64_t cols, int64_t batch, int mats, double bytes, struct pass_times pt, double membw,
                   double flops) {
    const double secs = pt.secs, gbps = bytes / secs / 1e9, gflops = flops / secs / 1e9;
    if (o->json) {
        json_t *jo = cli_jobj("ssssiIIIiffffff", "test", "kernel", "kernel", o->kernel, "type", moetax_type_name(t),
                              "case", cs, "threads", threads, "rows", (int64_t)rows, "cols", (int64_t)cols, "batch",
                              (int64_t)batch, "mats", mats, "bytes", bytes, "ms", secs * 1e3, "gbps", gbps,
                              "membw_gbps", membw, "roofline_ratio", gbps / membw, "gflops", gflops);
        if (jo && !cli_paired_json(jo, "paired_ratio", pt.paired)) {
            json_decref(jo);
            jo = NULL;
        }
        if (cli_json_print(stdout, jo)) fprintf(stderr, "moetax bench kernels: cannot write the JSON line\n");
    } else {
        char paired[32];
        if (cli_paired_bad(pt.paired)) snprintf(paired, sizeof paired, "error %.2f", pt.paired);
        else snprintf(paired, sizeof paired, "%.3f", pt.paired);
        printf("%-5s %3d  %-7s %7lld x %-5lld %5lld %5d %10.3f %8.2f %6.3f %6s %9.2f\n", moetax_type_name(t),
               threads, cs, (long long)rows, (long long)cols, (long long)batch, mats, secs * 1e3, gbps, gbps / membw,
               paired, gflops);
        o->paired_bad |= cli_paired_bad(pt.paired);
    }
    fflush(stdout);
}

/* Fill the buffer with valid rows of type t (finite values, sane scales):
 * a few distinct 4096-column rows repeated. Block structure survives any
 * column count that is a multiple of 32. */
static void fill_weights(enum moetax_type t, uint8_t *buf, size_t bytes) {
    enum { N = 4096, DISTINCT = 61 };
    const size_t rb = moetax_row_size(t, N);
    uint8_t *rows = malloc(rb * DISTINCT);
    float *x = malloc(sizeof(float) * N);
    uint64_t s = 0x2545f4914f6cdd1dull;
    for (int r = 0; r < DISTINCT; r++) {
        for (int i = 0; i < N; i++) {
            s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
            x[i] = (float)((double)((s * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0 - 0.5) * 0.1f;
        }
        moetax_from_float(t, x, rows + (size_t)r * rb, N);
    }
    for (size_t off = 0, r = 0; off < bytes; off += rb, r = (r + 1) % DISTINCT)
        memcpy(buf + off, rows + r * rb, bytes - off < rb ? bytes - off : rb);
    free(rows);
    free(x);
}

/* Put the buffer in the layout k's matmul reads for rows of `cols` columns, as
 * the model does at load (moetax_kernels_repack, in place; one unit: the
 * matrices in it are whole row groups); *laid_cols is the column count it is
 * laid out for now (0: as filled). */
static moetax_status layout_weights(const struct moetax_kernels *k, enum moetax_type t, uint8_t *buf, size_t bytes,
                                    int64_t cols, int64_t *laid_cols) {
    if (!k->weights_repacked(t) || *laid_cols == cols) return MOETAX_OK;
    if (*laid_cols) fill_weights(t, buf, bytes); /* back to the stored layout */
    const size_t rb = moetax_row_size(t, cols);
    moetax_status st = moetax_kernels_repack(k, t, buf, buf, (int64_t)(bytes / rb), cols);
    *laid_cols = st ? 0 : cols;
    return st;
}

enum { CASE_MATRIX = 1, CASE_EXPERT = 2, CASE_GROUP8 = 4, CASE_BATCH = 8 };

int bench_kernels_main(int argc, char **argv) {
    const char *cmd = "bench kernels";
    int64_t threads[BK_MAX_T];
    int n_t = 0;
    enum moetax_type types[BK_MAX_TYPES] = {MOETAX_TYPE_F32, MOETAX_TYPE_F16, MOETAX_TYPE_BF16, MOETAX_TYPE_Q8_0,
                                            MOETAX_TYPE_Q4_0};
    int n_types = 5;
    int64_t reps = 7, size_mib = 256, cols = 4096;
    int64_t erows = 1408, ecols = 2048; /* --expert */
    int cases = CASE_MATRIX | CASE_EXPERT | CASE_GROUP8 | CASE_BATCH;
    enum { BK_MAX_BATCHES = 16 };
    int64_t batches[BK_MAX_BATCHES] = {2, 8, 64};
    int n_batches = 3;
    bool pin = false;
    struct bk_out out = {.json = false};

    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        bool err = false;
        if (cli_flag(argv, i, "-h", "--help")) {
            usage(stdout);
            return 0;
        } else if (cli_opt(argc, argv, &i, "-t", "--threads", &v, &err)) {
            if (err) return 2;
            if ((n_t = cli_parse_threads(cmd, v, threads, BK_MAX_T)) < 0) return 2;
        } else if (cli_opt(argc, argv, &i, NULL, "--types", &v, &err)) {
            if (err) return 2;
            char tmp[256];
            snprintf(tmp, sizeof tmp, "%s", v);
            n_types = 0;
            for (char *save = NULL, *tok = strtok_r(tmp, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
                enum moetax_type t;
                if (!moetax_type_from_name(tok, &t) || !moetax_type_supported(t))
                    return cli_usage_error(cmd, "unsupported type '%s' (f32, f16, bf16, q8_0, q4_0, q2_k, q3_k, q4_k, q5_k, q6_k)", tok);
                if (n_types == BK_MAX_TYPES) return cli_usage_error(cmd, "too many types");
                types[n_types++] = t;
            }
            if (n_types == 0) return cli_usage_error(cmd, "empty --types");
        } else if (cli_opt(argc, argv, &i, "-r", "--reps", &v, &err)) {
            if (err) return 2;
            if (!cli_parse_i64(v, &reps) || reps < 1 || reps > 100000) return cli_usage_error(cmd, "bad --reps '%s'", v);
        } else if (cli_opt(argc, argv, &i, NULL, "--size-mib", &v, &err)) {
            if (err) return 2;
            if (!cli_parse_i64(v, &size_mib) || size_mib < 8 || size_mib > (1 << 20))
                return cli_usage_error(cmd, "bad --size-mib '%s' (>= 8)", v);
        } else if (cli_opt(argc, argv, &i, NULL, "--cols", &v, &err)) {
            if (err) return 2;
            if (!cli_parse_i64(v, &cols) || cols < 32 || cols % 32 != 0 || cols > (1 << 24))
                return cli_usage_error(cmd, "bad --cols '%s' (a multiple of 32)", v);
        } else if (cli_opt(argc, argv, &i, NULL, "--batch", &v, &err)) {
            if (err) return 2;
            char tmp[256];
            snprintf(tmp, sizeof tmp, "%s", v);
            n_batches = 0;
            for (char *save = NULL, *tok = strtok_r(tmp, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
                int64_t b;
                if (!cli_parse_i64(tok, &b) || b < 1 || b > BK_MAX_BATCH)
                    return cli_usage_error(cmd, "bad --batch '%s' (1..%d)", tok, BK_MAX_BATCH);
                if (n_batches == BK_MAX_BATCHES) return cli_usage_error(cmd, "too many --batch sizes");
                batches[n_batches++] = b;
            }
            if (n_batches == 0) return cli_usage_error(cmd, "empty --batch");
        } else if (cli_opt(argc, argv, &i, NULL, "--cases", &v, &err)) {
            if (err) return 2;
            char tmp[256];
            snprintf(tmp, sizeof tmp, "%s", v);
            cases = 0;
            for (char *save = NULL, *tok = strtok_r(tmp, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
                if (!strcmp(tok, "matrix")) cases |= CASE_MATRIX;
                else if (!strcmp(tok, "expert")) cases |= CASE_EXPERT;
                else if (!strcmp(tok, "group8")) cases |= CASE_GROUP8;
                else if (!strcmp(tok, "batch")) cases |= CASE_BATCH;
                else return cli_usage_error(cmd, "unknown case '%s' (matrix, expert, group8, batch)", tok);
            }
        } else if (cli_opt(argc, argv, &i, NULL, "--expert", &v, &err)) {
            if (err) return 2;
            const char *x = strchr(v, 'x');
            char tmp[64];
            snprintf(tmp, sizeof tmp, "%.*s", x ? (int)(x - v) : 0, v);
            if (!x || !cli_parse_i64(tmp, &erows) || !cli_parse_i64(x + 1, &ecols) || erows < 32 || ecols < 32 ||
                erows % 32 || ecols % 32 || erows > 65536 || ecols > 65536)
                return cli_usage_error(cmd, "bad --expert '%s' (ROWSxCOLS, each a multiple of 32, 32..65536)", v);
        } else if (cli_flag(argv, i, NULL, "--pin")) {
            pin = true;
        } else if (cli_flag(argv, i, NULL, "--json")) {
            out.json = true;
        } else {
            return cli_usage_error(cmd, "unknown option '%s'", argv[i]);
        }
    }
    if (n_t == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        if (n < 1) n = 1;
        if (n > BK_MAX_T) n = BK_MAX_T;
        for (int k = 0; k < n; k++) threads[n_t++] = k + 1;
    }

    const size_t bytes = (size_t)size_mib << 20;
    for (int ti = 0; ti < n_types; ti++) /* group8 takes 8 of the expert matrices per run */
        if ((cases & (CASE_EXPERT | CASE_GROUP8)) && 8 * moetax_row_size(types[ti], ecols) * (size_t)erows > bytes)
            return cli_usage_error(cmd, "--expert %lldx%lld: 8 %s matrices do not fit --size-mib %lld",
                                   (long long)erows, (long long)ecols, moetax_type_name(types[ti]), (long long)size_mib);
    const struct moetax_kernels *k = moetax_kernels_get();
    out.kernel = k->name;
    uint8_t *buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) return cli_fail(cmd, moetax_error(MOETAX_ERR_NOMEM, "mmap %zu bytes failed", bytes));
#ifdef MADV_HUGEPAGE
    madvise(buf, bytes, MADV_HUGEPAGE);
#endif
    /* activations: up to 64 rows of the widest case; y for the largest output */
    const int64_t emax = erows > ecols ? erows : ecols, max_cols = cols > emax ? cols : emax;
    float *x = malloc(sizeof(float) * (size_t)(BK_MAX_BATCH * max_cols));
    for (int64_t i = 0; i < BK_MAX_BATCH * max_cols; i++) x[i] = (float)((i * 7919) % 2001 - 1000) * 1e-3f;
    void *xq = malloc(moetax_act_size(MOETAX_TYPE_F32, max_cols, BK_MAX_BATCH)); /* the largest layout */
    /* y: the most rows x batch of any case (matrix rows, 8 experts, ~2 GFLOP batch slices) */
    size_t y_floats = 8 * (size_t)emax + (size_t)(2e9 / (2.0 * (double)cols));
    for (int ti = 0; ti < n_types; ti++) {
        const size_t r = bytes / moetax_row_size(types[ti], cols) + 1;
        if (r > y_floats) y_floats = r;
    }
    float *y = malloc(sizeof(float) * y_floats);
    if (!x || !xq || !y) {
        munmap(buf, bytes);
        free(x), free(xq), free(y);
        return cli_fail(cmd, moetax_error(MOETAX_ERR_NOMEM, "out of memory"));
    }

    if (!out.json) {
        printf("kernels '%s'%s%s, %lld MiB buffer, median of %lld runs; ratio = GB/s / read bandwidth of the same pool;\n"
               "paired = median of GB/s / a plain read of the same bytes just before each run\n",
               k->name, *moetax_kernels_extras(k) ? " with " : "", moetax_kernels_extras(k), (long long)size_mib,
               (long long)reps);
        printf("%-5s %3s  %-7s %15s %5s %5s %10s %8s %6s %6s %9s\n", "type", "thr", "case", "rows x cols", "batch",
               "mats", "ms", "GB/s", "ratio", "paired", "GFLOP/s");
    }
    cli_progress prog;
    cli_progress_init(&prog, "bench kernels", (uint64_t)(n_types * n_t));
    int rc = 0;
    for (int ti = 0; ti < n_types && rc == 0; ti++) {
        const enum moetax_type t = types[ti];
        fill_weights(t, buf, bytes);
        int64_t laid_cols = 0; /* the buffer's layout (see layout_weights) */
        for (int tk = 0; tk < n_t && rc == 0; tk++) {
            cli_progress_update(&prog, (uint64_t)(ti * n_t + tk));
            struct moetax_pool *pool = NULL;
            struct moetax_pool_params pp = {.n_threads = (int)threads[tk], .pin = pin};
            moetax_status st = moetax_pool_init(&pp, &pool);
            if (st != MOETAX_OK) {
                rc = cli_fail(cmd, st);
                break;
            }
            const int nth = moetax_pool_n_threads(pool);
            double membw = 0;
            st = moetax_membw_read(pool, bytes, (int)reps, &membw);
            if (st != MOETAX_OK) {
                moetax_pool_free(pool);
                rc = cli_fail(cmd, st);
                break;
            }
            if (prog.enabled) fprintf(stderr, "\r\033[K");

            struct mm_ctx base = {.k = k, .t = t, .w = buf, .n_mats = 1, .xq = xq, .y = y, .n_batch = 1};
            if (cases & CASE_MATRIX) {
                base.cols = cols;
                base.row_bytes = moetax_row_size(t, cols);
                base.rows = (int64_t)(bytes / base.row_bytes);
                if ((st = layout_weights(k, t, buf, bytes, cols, &laid_cols))) goto case_fail;
                k->quantize_act(t, x, cols, cols, 1, xq);
                const size_t mb = (size_t)base.rows * base.row_bytes;
                const struct pass_times s = time_pass(pool, base, 1, (int)reps, mb);
                report(&out, t, nth, "matrix", base.rows, cols, 1, 1, (double)mb, s, membw,
                       2.0 * (double)base.rows * (double)cols);
            }
            const int64_t shapes[2][2] = {{erows, ecols}, {ecols, erows}};
            for (int sh = 0; sh < 2 && (cases & (CASE_EXPERT | CASE_GROUP8)); sh++) {
                struct mm_ctx e = base;
                e.rows = shapes[sh][0];
                e.cols = shapes[sh][1];
                if (e.cols % moetax_type_blck_size(t)) {
                    if (!out.json)
                        printf("%-5s %3d  expert  %7lld x %-5lld  skipped: rows of %lld columns are not whole %s blocks "
                               "(%lld values; files store such matrices in another type)\n",
                               moetax_type_name(t), nth, (long long)e.rows, (long long)e.cols, (long long)e.cols,
                               moetax_type_name(t), (long long)moetax_type_blck_size(t));
                    continue;
                }
                e.row_bytes = moetax_row_size(t, e.cols);
                e.mat_stride = e.row_bytes * (size_t)e.rows;
                const int64_t n_exp = (int64_t)(bytes / e.mat_stride);

                if ((cases & (CASE_EXPERT | CASE_GROUP8)) && (st = layout_weights(k, t, buf, bytes, e.cols, &laid_cols)))
                    goto case_fail;
                k->quantize_act(t, x, e.cols, e.cols, 1, xq);
                if (cases & CASE_EXPERT) {
                    const struct pass_times s = time_pass(pool, e, n_exp, (int)reps, (size_t)n_exp * e.mat_stride);
                    report(&out, t, nth, "expert", e.rows, e.cols, 1, (int)n_exp, (double)n_exp * (double)e.mat_stride,
                           s, membw, 2.0 * (double)n_exp * (double)e.rows * (double)e.cols);
                }
                if ((cases & CASE_GROUP8) && sh == 0) {
                    e.n_mats = 8;
                    const int64_t n_runs = n_exp / 8;
                    const struct pass_times s =
                        time_pass(pool, e, n_runs, (int)reps, (size_t)n_runs * 8 * e.mat_stride);
                    report(&out, t, nth, "group8", e.rows, e.cols, 1, (int)(n_runs * 8),
                           (double)n_runs * 8.0 * (double)e.mat_stride, s, membw,
                           2.0 * (double)n_runs * 8.0 * (double)e.rows * (double)e.cols);
                }
            }
            if (cases & CASE_BATCH) {
                for (int bi = 0; bi < n_batches; bi++) {
                    struct mm_ctx c = base;
                    c.cols = cols;
                    c.row_bytes = moetax_row_size(t, cols);
                    c.n_batch = batches[bi];
                    const int64_t max_rows = (int64_t)(bytes / c.row_bytes);
                    int64_t rows = (int64_t)(2e9 / (2.0 * (double)cols * (double)c.n_batch)); /* ~2 GFLOP */
                    rows = rows > max_rows ? max_rows : rows < 8 ? 8 : rows / 8 * 8; /* whole row groups */
                    c.rows = rows;
                    if ((st = layout_weights(k, t, buf, bytes, cols, &laid_cols))) goto case_fail;
                    k->quantize_act(t, x, cols, cols, c.n_batch, xq);
                    const int r = reps < 3 ? (int)reps : 3;
                    const struct pass_times s = time_pass(pool, c, 1, r, (size_t)rows * c.row_bytes);
                    report(&out, t, nth, "batch", rows, cols, c.n_batch, 1, (double)rows * (double)c.row_bytes, s,
                           membw, 2.0 * (double)rows * (double)cols * (double)c.n_batch);
                }
            }
            if (!out.json)
                printf("%-5s %3d  %-7s %45.2f GB/s read bandwidth (membw, same pool)\n", moetax_type_name(t), nth,
                       "membw", membw);
            moetax_pool_free(pool);
            continue;
        case_fail:
            moetax_pool_free(pool);
            rc = cli_fail(cmd, st);
            break;
        }
    }
    cli_progress_done(&prog);
    if (out.paired_bad) cli_paired_note(stdout);
    munmap(buf, bytes);
    free(x), free(xq), free(y);
    return rc;
}
