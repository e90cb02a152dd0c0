/* io.c - the expert store's I/O side: background workers with a job queue
 * (Redis bio.c), the default VFS (open with or without O_DIRECT, pread, fstat,
 * close; replaceable like SQLite's VFS so tests can inject faults), and the
 * read helper that issues one pread per contiguous span. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "store/store_impl.h"

uint64_t store_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- default VFS ----------------------------------------------------------- */

static int posix_open(void *user, const char *path, bool direct, int *fd_out) {
    (void)user;
    int flags = O_RDONLY | O_CLOEXEC;
#ifdef O_DIRECT
    if (direct) flags |= O_DIRECT;
#else
    if (direct) return EINVAL;
#endif
    int fd;
    do {
        fd = open(path, flags);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return errno ? errno : EIO;
    *fd_out = fd;
    return 0;
}

static ssize_t posix_pread(void *user, int fd, void *buf, size_t n, uint64_t off) {
    (void)user;
    ssize_t r = pread(fd, buf, n, (off_t)off);
    return r < 0 ? -(ssize_t)(errno ? errno : EIO) : r;
}

static int posix_fstat_sig(void *user, int fd, uint64_t *size, uint64_t *mtime_ns) {
    (void)user;
    struct stat st;
    if (fstat(fd, &st) != 0) return errno ? errno : EIO;
    *size = (uint64_t)st.st_size;
    *mtime_ns = (uint64_t)st.st_mtim.tv_sec * 1000000000ull + (uint64_t)st.st_mtim.tv_nsec;
    return 0;
}

static void posix_close(void *user, int fd) {
    (void)user;
    close(fd);
}

static const struct moetax_store_vfs posix_vfs = {
    .open = posix_open, .pread = posix_pread, .fstat_sig = posix_fstat_sig, .close = posix_close, .user = NULL,
};

const struct moetax_store_vfs *moetax_store_vfs_default(void) { return &posix_vfs; }

int64_t store_io_read(const struct moetax_store_vfs *vfs, int fd, void *buf, uint64_t len, uint64_t need,
                      uint64_t off, uint64_t *ns, int *calls) {
    uint64_t t0 = store_now_ns(), got = 0;
    int n_calls = 0;
    int64_t ret = 0;
    while (got < len) {
        size_t want = (size_t)(len - got);
        if (want > ((size_t)1 << 30)) want = (size_t)1 << 30; /* pread caps near 2 GiB */
        ssize_t r = vfs->pread(vfs->user, fd, (uint8_t *)buf + got, want, off + got);
        n_calls++;
        if (r == -EINTR) continue;
        if (r < 0) {
            ret = got > 0 ? (int64_t)got : (int64_t)r; /* a later failure after progress reads as short */
            goto done;
        }
        if (r == 0) break; /* end of file */
        if ((size_t)r > want) { ret = -EIO; goto done; }
        got += (uint64_t)r;
        if (got < len && got >= need) break; /* the rest is past end of file */
    }
    ret = (int64_t)got;
done:
    *ns = store_now_ns() - t0;
    *calls = n_calls;
    return ret;
}

/* ---- workers ---------------------------------------------------------------- */

struct store_io {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int *next, *prev;    /* [n_jobs] intrusive doubly linked queue; -1 ends */
    bool *queued;        /* [n_jobs] */
    int head, tail;
    bool stop;
    store_io_fn fn;
    void *ctx;
    int n_threads;
    pthread_t *threads;
    struct io_arg {
        struct store_io *io;
        int index;
    } *args; /* [n_threads] */
};

static void q_unlink(struct store_io *io, int j) {
    if (io->prev[j] >= 0) io->next[io->prev[j]] = io->next[j]; else io->head = io->next[j];
    if (io->next[j] >= 0) io->prev[io->next[j]] = io->prev[j]; else io->tail = io->prev[j];
    io->next[j] = io->prev[j] = -1;
    io->queued[j] = false;
}

static void q_push(struct store_io *io, int j, bool front) {
    if (front) {
        io->prev[j] = -1;
        io->next[j] = io->head;
        if (io->head >= 0) io->prev[io->head] = j; else io->tail = j;
        io->head = j;
    } else {
        io->next[j] = -1;
        io->prev[j] = io->tail;
        if (io->tail >= 0) io->next[io->tail] = j; else io->head = j;
        io->tail = j;
    }
    io->queued[j] = true;
}

static void *io_main(void *arg) {
    struct store_io *io = ((struct io_arg *)arg)->io;
    const int index = ((struct io_arg *)arg)->index;
    pthread_mutex_lock(&io->mu);
    for (;;) {
        while (!io->stop && io->head < 0) pthread_cond_wait(&io->cv, &io->mu);
        if (io->stop) break;
        int j = io->head;
        q_unlink(io, j);
        pthread_mutex_unlock(&io->mu);
        io->fn(io->ctx, j, index);
        pthread_mutex_lock(&io->mu);
    }
    pthread_mutex_unlock(&io->mu);
    return NULL;
}

static void io_free(struct store_io *io) {
    if (!io) return;
    free(io->next);
    free(io->prev);
    free(io->queued);
    free(io->threads);
    free(io->args);
    pthread_cond_destroy(&io->cv);
    pthread_mutex_destroy(&io->mu);
    free(io);
}

moetax_status store_io_start(int n_threads, int n_jobs, store_io_fn fn, void *ctx, struct store_io **out) {
    *out = NULL;
    struct store_io *io = calloc(1, sizeof *io);
    if (!io) return moetax_error(MOETAX_ERR_NOMEM, "expert store: out of memory (I/O queue)");
    pthread_mutex_init(&io->mu, NULL);
    pthread_cond_init(&io->cv, NULL);
    io->next = malloc(sizeof(int) * (size_t)n_jobs);
    io->prev = malloc(sizeof(int) * (size_t)n_jobs);
    io->queued = calloc((size_t)n_jobs, sizeof(bool));
    io->threads = calloc((size_t)n_threads, sizeof(pthread_t));
    io->args = calloc((size_t)n_threads, sizeof *io->args);
    if (!io->next || !io->prev || !io->queued || !io->threads || !io->args) {
        io_free(io);
        return moetax_error(MOETAX_ERR_NOMEM, "expert store: out of memory (I/O queue)");
    }
    for (int j = 0; j < n_jobs; j++) io->next[j] = io->prev[j] = -1;
    io->head = io->tail = -1;
    io->fn = fn;
    io->ctx = ctx;
    for (int t = 0; t < n_threads; t++) {
        io->args[t] = (struct io_arg){io, t};
        int rc = pthread_create(&io->threads[t], NULL, io_main, &io->args[t]);
        if (rc != 0) {
            io->n_threads = t;
            store_io_stop(io);
            return moetax_error(MOETAX_ERR_INTERNAL, "expert store: cannot start I/O thread %d: error %d", t, rc);
        }
        io->n_threads = t + 1;
    }
    *out = io;
    return MOETAX_OK;
}

void store_io_stop(struct store_io *io) {
    if (!io) return;
    pthread_mutex_lock(&io->mu);
    io->stop = true;
    pthread_cond_broadcast(&io->cv);
    pthread_mutex_unlock(&io->mu);
    for (int t = 0; t < io->n_threads; t++) pthread_join(io->threads[t], NULL);
    io_free(io);
}

void store_io_push(struct store_io *io, int job, bool front) {
    pthread_mutex_lock(&io->mu);
    if (!io->queued[job]) {
        q_push(io, job, front);
        pthread_cond_signal(&io->cv);
    }
    pthread_mutex_unlock(&io->mu);
}

void store_io_promote(struct store_io *io, int job) {
    pthread_mutex_lock(&io->mu);
    if (io->queued[job] && io->head != job) {
        q_unlink(io, job);
        q_push(io, job, true);
    }
    pthread_mutex_unlock(&io->mu);
}
