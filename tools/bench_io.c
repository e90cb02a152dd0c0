/* bench_io.c - `moetax bench io`: sequential and random read bandwidth of a
 * file with O_DIRECT (or buffered) for each request size, queue depth and I/O
 * engine: pread (qd reader threads, each with one request in flight, like the
 * expert store's I/O workers) or uring (one thread keeping qd requests in
 * flight on an io_uring). It is the figure the store's achieved read_gbps is
 * compared with. Without -f it writes a temporary file in the current
 * directory, drops it from the page cache and removes it (unlinked as soon as
 * it is open, so an interrupted run leaves nothing behind). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench.h"
#include "cli.h"
#include "moetax/store.h"
#include "store/store_impl.h"

#define BENCH_IO_MAX_LIST 16
#define BENCH_IO_ALIGN 4096

static void usage(FILE *f) {
    fprintf(f,
            "usage: moetax bench io [options]\n"
            "Sequential and random read bandwidth (GB/s = 1e9 B/s) of a file for each request size, queue\n"
            "depth and I/O engine (pread: reader threads, one request in flight each; uring: one thread, qd\n"
            "requests in flight on an io_uring), with O_DIRECT so the page cache does not hide the device.\n"
            "This is what the expert store's read_gbps is compared with.\n"
            "\n"
            "options:\n"
            "  -f, --file FILE      read this file (e.g. the model); default: write a temporary file of\n"
            "                       --size-mib in the current directory and remove it afterwards\n"
            "      --size-mib N     temporary file size in MiB (default 1024)\n"
            "      --req-kib LIST   request sizes in KiB, multiples of 4 (default 64,256,1024,4096)\n"
            "      --qd LIST        queue depths (default 1,2,4)\n"
            "      --engine LIST    pread (qd threads, one pread each in flight), uring (one thread, qd reads in\n"
            "                       flight on an io_uring), or both (the default: pread,uring, side by side);\n"
            "                       the store cases run with the store's --io-engine of the same name\n"
            "      --seconds S      at most this long per case (default 2); each case reads the file once\n"
            "      --buffered       buffered reads (pages dropped with posix_fadvise before each case)\n"
            "      --no-store       skip the expert store cases (store_seq: experts of one request each at\n"
            "                       32-aligned offsets, acquired in order with 2 x qd prefetched ahead by\n"
            "                       qd I/O workers; gbps end to end, read_gbps as the store reports it)\n"
            "      --json           one JSON object per case:\n"
            "                         {\"test\":\"io_seq\"|\"io_rand\",\"engine\",\"req_bytes\",\"qd\",\"gbps\",\"bytes\",\n"
            "                          \"seconds\",\"lat_us_mean\",\"lat_us_max\",\"direct\"}\n"
            "                         {\"test\":\"store_seq\",\"engine\",\"req_bytes\",\"qd\",\"gbps\",\"read_gbps\",\n"
            "                          \"bytes\",\"seconds\",\"stall_us_mean\",\"hit_rate\",\"direct\"}\n"
            "  -h, --help           this text\n");
}

static double now_s(void) { return cli_now(); }

struct io_case {
    int fd;
    uint64_t req, n_blocks;
    bool random;
    double deadline;
    _Atomic uint64_t next;     /* sequential: next block; random: requests issued */
    _Atomic uint64_t bytes, n_req;
    _Atomic int failed;        /* errno of the first failure */
    double lat_sum[64], lat_max[64];
};

struct io_thread {
    struct io_case *c;
    int id;
};

static void *reader(void *arg) {
    struct io_thread *t = arg;
    struct io_case *c = t->c;
    void *buf = NULL;
    if (posix_memalign(&buf, BENCH_IO_ALIGN, (size_t)c->req) != 0) {
        atomic_store(&c->failed, ENOMEM);
        return NULL;
    }
    uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(t->id + 1);
    double lsum = 0, lmax = 0;
    for (;;) {
        uint64_t k = atomic_fetch_add(&c->next, 1);
        if (k >= c->n_blocks || atomic_load(&c->failed)) break;
        if ((k & 15) == 0 && now_s() > c->deadline) break;
        uint64_t blk = k;
        if (c->random) {
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            blk = rng % c->n_blocks;
        }
        double t0 = now_s();
        ssize_t r = pread(c->fd, buf, (size_t)c->req, (off_t)(blk * c->req));
        double dt = now_s() - t0;
        if (r < 0 && errno == EINTR) continue;
        if (r != (ssize_t)c->req) {
            atomic_store(&c->failed, r < 0 ? errno : EIO);
            break;
        }
        lsum += dt;
        if (dt > lmax) lmax = dt;
        atomic_fetch_add(&c->bytes, (uint64_t)r);
        atomic_fetch_add(&c->n_req, 1);
    }
    c->lat_sum[t->id] = lsum;
    c->lat_max[t->id] = lmax;
    free(buf);
    return NULL;
}

/* The uring engine: this thread keeps qd reads in flight on one ring. Returns 0, or the errno
 * of a ring that cannot be set up (the case is then skipped); read failures go to c->failed. */
static int uring_reader(struct io_case *c, int qd) {
    struct store_ring *r = NULL;
    int rc = store_ring_init((unsigned)qd, &r);
    if (rc) return -rc;
    void *buf[64] = {0};
    uint64_t off[64];
    double t_sub[64];
    int free_list[64], n_free = 0;
    for (int i = 0; i < qd; i++) {
        if (posix_memalign(&buf[i], BENCH_IO_ALIGN, (size_t)c->req) != 0) {
            atomic_store(&c->failed, ENOMEM);
            break;
        }
        free_list[n_free++] = i;
    }
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    double lsum = 0, lmax = 0;
    int in_flight = 0;
    bool stop = atomic_load(&c->failed) != 0;
    for (;;) {
        while (!stop && n_free > 0) {
            uint64_t k = atomic_fetch_add(&c->next, 1);
            if (k >= c->n_blocks || ((k & 15) == 0 && now_s() > c->deadline)) {
                stop = true;
                break;
            }
            uint64_t blk = k;
            if (c->random) {
                rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
                blk = rng % c->n_blocks;
            }
            int i = free_list[--n_free];
            off[i] = blk * c->req;
            t_sub[i] = now_s();
            if (store_ring_prep(r, c->fd, buf[i], (size_t)c->req, off[i], (uint64_t)i) != 0) {
                atomic_store(&c->failed, EIO);
                stop = true;
                break;
            }
            in_flight++;
        }
        int submitted = 0;
        int src = store_ring_submit(r, &submitted);
        if (src < 0) { /* a broken ring: what was queued never went */
            atomic_store(&c->failed, -src);
            break;
        }
        if (in_flight == 0) break;
        uint64_t tag;
        int res;
        if (store_ring_wait(r, &tag, &res) != 0) {
            atomic_store(&c->failed, EIO);
            break;
        }
        in_flight--;
        int i = (int)tag;
        double dt = now_s() - t_sub[i];
        if (res == -EINTR || res == -EAGAIN) { /* again, same block */
            if (store_ring_prep(r, c->fd, buf[i], (size_t)c->req, off[i], (uint64_t)i) == 0) {
                in_flight++;
                continue;
            }
            res = -EIO;
        }
        free_list[n_free++] = i;
        if (res != (int)c->req) {
            atomic_store(&c->failed, res < 0 ? -res : EIO);
            stop = true;
            continue;
        }
        lsum += dt;
        if (dt > lmax) lmax = dt;
        atomic_fetch_add(&c->bytes, (uint64_t)res);
        atomic_fetch_add(&c->n_req, 1);
    }
    c->lat_sum[0] = lsum;
    c->lat_max[0] = lmax;
    store_ring_free(r); /* waits for nothing: every read was reaped unless the ring broke */
    for (int i = 0; i < qd; i++) free(buf[i]);
    return 0;
}

double bench_io_measure(const char *file, uint64_t req, int qd, bool random, bool buffered, double seconds) {
    int fd = open(file, O_RDONLY | O_CLOEXEC | (buffered ? 0 : O_DIRECT));
    if (fd < 0 && !buffered) fd = open(file, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    struct stat sb;
    if (fstat(fd, &sb) != 0 || req == 0 || (uint64_t)sb.st_size < req || qd < 1 || qd > 64) {
        close(fd);
        return -1;
    }
    req = (req + BENCH_IO_ALIGN - 1) / BENCH_IO_ALIGN * BENCH_IO_ALIGN;
    if ((uint64_t)sb.st_size < req) { close(fd); return -1; }
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    struct io_case *c = calloc(1, sizeof *c);
    if (!c) { close(fd); return -1; }
    c->fd = fd;
    c->req = req;
    c->n_blocks = (uint64_t)sb.st_size / req;
    c->random = random;
    pthread_t th[64];
    struct io_thread ta[64];
    double t0 = now_s();
    c->deadline = t0 + seconds;
    int started = 0;
    for (int t = 0; t < qd; t++) {
        ta[t] = (struct io_thread){c, t};
        if (pthread_create(&th[t], NULL, reader, &ta[t]) != 0) break;
        started++;
    }
    for (int t = 0; t < started; t++) pthread_join(th[t], NULL);
    double dt = now_s() - t0;
    double gbps = atomic_load(&c->failed) || started < qd || dt <= 0 ? -1 : (double)atomic_load(&c->bytes) / dt / 1e9;
    free(c);
    close(fd);
    return gbps;
}

/* Write size bytes of non-repeating data; returns 0 or errno. */
static int write_file(int fd, uint64_t size) {
    const size_t chunk = 8u << 20;
    uint64_t *buf = malloc(chunk);
    if (!buf) return ENOMEM;
    uint64_t x = 0x2545f4914f6cdd1dull;
    cli_progress prog;
    cli_progress_init(&prog, "bench io: writing", size);
    int rc = 0;
    for (uint64_t done = 0; done < size && !rc;) {
        for (size_t i = 0; i < chunk / 8; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            buf[i] = x;
        }
        size_t n = size - done < chunk ? (size_t)(size - done) : chunk;
        for (size_t w = 0; w < n;) {
            ssize_t r = write(fd, (const char *)buf + w, n - w);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                rc = r < 0 ? errno : EIO;
                break;
            }
            w += (size_t)r;
        }
        done += n;
        cli_progress_update(&prog, done);
    }
    if (prog.enabled) cli_progress_done(&prog);
    free(buf);
    if (!rc && fsync(fd) != 0) rc = errno;
    return rc;
}

/* The expert store over the same file: experts of req bytes at offsets 32 +
 * k * req (aligned to 32 like GGUF tensors, not to 4096), acquired in order
 * while the next 2 * qd are prefetched by qd I/O workers. */
static moetax_status store_case(const char *file, uint64_t size, uint64_t req, int qd,
                                enum moetax_store_io_engine engine, bool buffered, double seconds, bool json) {
    uint64_t n = (size - 32) / req;
    if (n > (1u << 20)) n = 1u << 20;
    struct moetax_store *s = NULL;
    struct moetax_store_params p = {
        .path = file, .buffered_io = buffered, .n_io_threads = qd, .io_engine = engine, .trace_cap = -1};
    p.budget_bytes = (uint64_t)(2 * qd + 1) * (((req + 2 * 4096 - 1) / 4096) * 4096);
    moetax_status st = moetax_store_init(&p, 1, (int)n, &s);
    for (uint64_t k = 0; k < n && st == MOETAX_OK; k++) {
        uint64_t off = 32 + k * req;
        st = moetax_store_add_expert(s, 0, (int)k, &off, &req, 1);
    }
    if (st == MOETAX_OK) st = moetax_store_commit(s);
    double t0 = now_s();
    uint64_t done = 0;
    for (uint64_t k = 0; k < n && st == MOETAX_OK; k++) {
        int32_t ahead[128];
        int na = 0;
        for (uint64_t j = k + 1; j <= k + 2 * (uint64_t)qd && j < n; j++) ahead[na++] = (int32_t)j;
        moetax_store_prefetch(s, 0, ahead, na, false);
        const void *ptr = NULL;
        st = moetax_store_acquire(s, 0, (int)k, &ptr, NULL);
        if (st != MOETAX_OK) break;
        moetax_store_release(s, 0, (int)k);
        done++;
        if ((k & 7) == 0 && now_s() - t0 > seconds) break;
    }
    double dt = now_s() - t0;
    if (st == MOETAX_OK) {
        struct moetax_store_stats ss;
        moetax_store_get_stats(s, &ss);
        double gbps = dt > 0 ? (double)(done * req) / dt / 1e9 : 0;
        double stall = ss.acquires ? (double)ss.stall_ns / (double)ss.acquires / 1e3 : 0;
        double hit = ss.acquires ? (double)ss.hits / (double)ss.acquires : 0;
        if (json)
            printf("{\"test\":\"store_seq\",\"engine\":\"%s\",\"req_bytes\":%llu,\"qd\":%d,\"gbps\":%.3f,"
                   "\"read_gbps\":%.3f,\"bytes\":%llu,\"seconds\":%.3f,\"stall_us_mean\":%.1f,\"hit_rate\":%.3f,"
                   "\"direct\":%s}\n",
                   moetax_store_io_engine_name(ss.io_engine), (unsigned long long)req, qd, gbps, ss.read_gbps, (unsigned long long)(done * req), dt, stall, hit,
                   ss.direct_io_active ? "true" : "false");
        else
            printf("%-6s %-6s %9llu %4d %9.3f %11.1f %12.1f   store: read_gbps %.3f, hit rate %.2f%s\n", "store",
                   moetax_store_io_engine_name(ss.io_engine), (unsigned long long)(req >> 10), qd, gbps, (double)(done * req) / 1048576.0, stall, ss.read_gbps,
                   hit, ss.direct_io_fallback ? ", O_DIRECT refused: buffered" : "");
        fflush(stdout);
    }
    moetax_store_free(s);
    return st;
}

int bench_io_main(int argc, char **argv) {
    const char *cmd = "bench io";
    const char *file = NULL;
    int64_t size_mib = 1024, req_kib[BENCH_IO_MAX_LIST] = {64, 256, 1024, 4096}, qd[BENCH_IO_MAX_LIST] = {1, 2, 4};
    int n_req = 4, n_qd = 3, n_eng = 2;
    enum moetax_store_io_engine engines[2] = {MOETAX_STORE_IO_PREAD, MOETAX_STORE_IO_URING};
    double seconds = 2.0;
    bool buffered = false, json = false, with_store = true;

    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        bool err = false;
        if (cli_flag(argv, i, "-h", "--help")) {
            usage(stdout);
            return 0;
        } else if (cli_opt(argc, argv, &i, "-f", "--file", &v, &err)) {
            if (err) return 2;
            file = v;
        } else if (cli_opt(argc, argv, &i, NULL, "--size-mib", &v, &err)) {
            if (err) return 2;
            if (!cli_parse_i64(v, &size_mib) || size_mib < 1 || size_mib > (1 << 22))
                return cli_usage_error(cmd, "bad --size-mib '%s'", v);
        } else if (cli_opt(argc, argv, &i, NULL, "--req-kib", &v, &err)) {
            if (err) return 2;
            n_req = cli_parse_int_list(v, req_kib, BENCH_IO_MAX_LIST);
            if (n_req <= 0) return cli_usage_error(cmd, "bad --req-kib '%s'", v);
            for (int k = 0; k < n_req; k++)
                if (req_kib[k] < 4 || req_kib[k] % 4 || req_kib[k] > (1 << 20))
                    return cli_usage_error(cmd, "request size %lld KiB: must be a multiple of 4 KiB (O_DIRECT)",
                                           (long long)req_kib[k]);
        } else if (cli_opt(argc, argv, &i, NULL, "--qd", &v, &err)) {
            if (err) return 2;
            n_qd = cli_parse_int_list(v, qd, BENCH_IO_MAX_LIST);
            if (n_qd <= 0) return cli_usage_error(cmd, "bad --qd '%s'", v);
            for (int k = 0; k < n_qd; k++)
                if (qd[k] < 1 || qd[k] > 64) return cli_usage_error(cmd, "queue depth %lld out of 1..64", (long long)qd[k]);
        } else if (cli_opt(argc, argv, &i, NULL, "--engine", &v, &err)) {
            if (err) return 2;
            if (!strcmp(v, "pread,uring") || !strcmp(v, "both")) {
                n_eng = 2;
            } else if (!strcmp(v, "uring,pread")) {
                n_eng = 2;
                engines[0] = MOETAX_STORE_IO_URING;
                engines[1] = MOETAX_STORE_IO_PREAD;
            } else if (moetax_store_io_engine_parse(v, &engines[0])) {
                n_eng = 1;
            } else {
                return cli_usage_error(cmd, "bad --engine '%s': pread, uring or pread,uring", v);
            }
        } else if (cli_opt(argc, argv, &i, NULL, "--seconds", &v, &err)) {
            if (err) return 2;
            if (!cli_parse_f64(v, &seconds) || !(seconds > 0) || seconds > 3600)
                return cli_usage_error(cmd, "bad --seconds '%s'", v);
        } else if (cli_flag(argv, i, NULL, "--buffered")) {
            buffered = true;
        } else if (cli_flag(argv, i, NULL, "--no-store")) {
            with_store = false;
        } else if (cli_flag(argv, i, NULL, "--json")) {
            json = true;
        } else {
            return cli_usage_error(cmd, "unknown option '%s'", argv[i]);
        }
    }

    char tmp[64] = "";
    int fd = -1, open_err = 0;
    if (!file) {
        /* the temporary file is opened for reading and unlinked before it is written: the descriptors
         * keep it, and a signal or a crash during the write leaves nothing behind */
        snprintf(tmp, sizeof tmp, "moetax-bench-io-XXXXXX");
        int wfd = mkstemp(tmp);
        if (wfd < 0)
            return cli_fail(cmd, moetax_error(MOETAX_ERR_IO, "cannot create a temporary file in the current "
                                                             "directory: %s", strerror(errno)));
        fd = open(tmp, O_RDONLY | O_CLOEXEC | (buffered ? 0 : O_DIRECT));
        open_err = errno;
        unlink(tmp);
        int rc = fd < 0 ? 0 : write_file(wfd, (uint64_t)size_mib << 20);
        if (!rc && fd >= 0) posix_fadvise(wfd, 0, 0, POSIX_FADV_DONTNEED);
        close(wfd);
        if (rc) {
            close(fd);
            return cli_fail(cmd, moetax_error(MOETAX_ERR_IO, "%s: cannot write %lld MiB: %s", tmp,
                                              (long long)size_mib, strerror(rc)));
        }
        file = tmp;
    } else {
        struct stat fsb; /* before open: a FIFO blocks there, a directory or device fails O_DIRECT's way */
        if (stat(file, &fsb) == 0 && !S_ISREG(fsb.st_mode))
            return cli_fail(cmd, moetax_error(MOETAX_ERR_ARG, "%s: not a regular file (%s)", file,
                                              S_ISDIR(fsb.st_mode) ? "a directory" : "a device, FIFO or socket"));
        fd = open(file, O_RDONLY | O_CLOEXEC | (buffered ? 0 : O_DIRECT));
        open_err = errno;
    }
    if (fd < 0)
        return cli_fail(cmd, moetax_error(MOETAX_ERR_IO, "%s: cannot open%s: %s%s", file,
                                          buffered ? "" : " with O_DIRECT", strerror(open_err),
                                          !buffered && open_err == EINVAL ? " (the filesystem refuses O_DIRECT; "
                                                                            "try --buffered)" : ""));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        close(fd);
        return cli_fail(cmd, moetax_error(MOETAX_ERR_IO, "%s: cannot stat: %s", file, strerror(errno)));
    }
    uint64_t size = (uint64_t)sb.st_size;

    if (!json) {
        printf("read bandwidth of %s (%.1f MiB%s), %s, at most %.1f s per case\n", tmp[0] ? "a temporary file" : file,
               size / 1048576.0, tmp[0] ? ", removed" : "", buffered ? "buffered (page cache dropped)" : "O_DIRECT",
               seconds);
        printf("%-6s %-6s %9s %4s %9s %11s %12s %12s\n", "test", "engine", "req KiB", "qd", "GB/s", "MiB read",
               "lat us mean", "lat us max");
    }
    int status = 0;
    for (int pat = 0; pat < 2 && !status; pat++)
        for (int r = 0; r < n_req && !status; r++)
            for (int q = 0; q < n_qd && !status; q++)
            for (int en = 0; en < n_eng && !status; en++) {
                const bool uring = engines[en] == MOETAX_STORE_IO_URING;
                const char *ename = moetax_store_io_engine_name(engines[en]);
                uint64_t req = (uint64_t)req_kib[r] << 10;
                if (req > size) {
                    if (!json) printf("%-6s %-6s %9lld %4lld  (file smaller than one request: skipped)\n",
                                      pat ? "rand" : "seq", ename, (long long)req_kib[r], (long long)qd[q]);
                    continue;
                }
                posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
                struct io_case *c = calloc(1, sizeof *c);
                if (!c) {
                    status = cli_fail(cmd, moetax_error(MOETAX_ERR_NOMEM, "out of memory"));
                    break;
                }
                c->fd = fd;
                c->req = req;
                c->n_blocks = size / req;
                c->random = pat == 1;
                pthread_t th[64];
                struct io_thread ta[64];
                int nt = (int)qd[q];
                double t0 = now_s();
                c->deadline = t0 + seconds;
                int started = 0;
                if (uring) {
                    int rc = uring_reader(c, nt);
                    if (rc) {
                        if (!json)
                            printf("%-6s %-6s %9lld %4d  (io_uring unavailable: %s)\n", pat ? "rand" : "seq", ename,
                                   (long long)req_kib[r], nt, strerror(rc));
                        else
                            fprintf(stderr, "moetax bench io: %s, %lld KiB, qd %d: skipped, io_uring unavailable: %s\n",
                                    pat ? "rand" : "seq", (long long)req_kib[r], nt, strerror(rc));
                        free(c);
                        continue;
                    }
                    started = nt;
                } else {
                    for (int t = 0; t < nt; t++) {
                        ta[t] = (struct io_thread){c, t};
                        if (pthread_create(&th[t], NULL, reader, &ta[t]) != 0) break;
                        started++;
                    }
                    for (int t = 0; t < started; t++) pthread_join(th[t], NULL);
                }
                double dt = now_s() - t0;
                int failed = atomic_load(&c->failed);
                if (failed || started < nt) {
                    status = cli_fail(cmd, moetax_error(MOETAX_ERR_IO, "%s: %s %s reads of %llu bytes failed: %s",
                                                        file, pat ? "random" : "sequential", ename,
                                                        (unsigned long long)req, strerror(failed ? failed : EAGAIN)));
                    free(c);
                    break;
                }
                uint64_t bytes = atomic_load(&c->bytes), nr = atomic_load(&c->n_req);
                double lsum = 0, lmax = 0;
                for (int t = 0; t < nt; t++) {
                    lsum += c->lat_sum[t];
                    if (c->lat_max[t] > lmax) lmax = c->lat_max[t];
                }
                double gbps = dt > 0 ? (double)bytes / dt / 1e9 : 0;
                double lmean = nr ? lsum / (double)nr * 1e6 : 0;
                if (json)
                    printf("{\"test\":\"%s\",\"engine\":\"%s\",\"req_bytes\":%llu,\"qd\":%d,\"gbps\":%.3f,"
                           "\"bytes\":%llu,\"seconds\":%.3f,\"lat_us_mean\":%.1f,\"lat_us_max\":%.1f,\"direct\":%s}\n",
                           pat ? "io_rand" : "io_seq", ename, (unsigned long long)req, nt, gbps, (unsigned long long)bytes,
                           dt, lmean, lmax * 1e6, buffered ? "false" : "true");
                else
                    printf("%-6s %-6s %9lld %4d %9.3f %11.1f %12.1f %12.1f\n", pat ? "rand" : "seq", ename,
                           (long long)req_kib[r], nt, gbps, bytes / 1048576.0, lmean, lmax * 1e6);
                fflush(stdout);
                free(c);
            }
    for (int r = 0; r < n_req && !status && with_store; r++)
        for (int q = 0; q < n_qd && !status; q++)
        for (int en = 0; en < n_eng && !status; en++) {
            uint64_t req = (uint64_t)req_kib[r] << 10;
            if (req + 32 > size) continue;
            char fdpath[64]; /* the temporary file is already unlinked: reopen it through /proc */
            snprintf(fdpath, sizeof fdpath, "/proc/self/fd/%d", fd);
            posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
            moetax_status st =
                store_case(tmp[0] ? fdpath : file, size, req, (int)qd[q], engines[en], buffered, seconds, json);
            if (st != MOETAX_OK) status = cli_fail(cmd, st);
        }
    close(fd);
    return status;
}
