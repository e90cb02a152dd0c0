/* store_impl.h - internals shared by the expert store's files: the I/O
 * workers' job queue (io.c) and the aligned read helper. Not a public header. */
#ifndef MOETAX_STORE_IMPL_H
#define MOETAX_STORE_IMPL_H

#include <stdbool.h>
#include <stdint.h>

#include "moetax/status.h"
#include "moetax/store.h"

/* Background I/O workers (Redis bio.c): dedicated pthreads that run
 * fn(ctx, job, worker) (worker: 0..n_threads-1, the thread running it) for jobs taken from one queue. Jobs are small integers in
 * [0, n_jobs) (the store's slot indices); a job is in the queue at most once.
 * fn runs without any queue lock held; completion is the caller's business
 * (the store marks the slot READY/ERROR and broadcasts its own condvar). */
typedef void (*store_io_fn)(void *ctx, int job, int worker);
struct store_io;

moetax_status store_io_start(int n_threads, int n_jobs, store_io_fn fn, void *ctx, struct store_io **out);
/* Wake and join the workers; a job being run completes, queued jobs are dropped. */
void store_io_stop(struct store_io *io);
/* Queue job at the head (demand) or the tail (prefetch). No-op if queued. */
void store_io_push(struct store_io *io, int job, bool front);
/* Move a queued job to the head; no-op if it is not queued (running or done). */
void store_io_promote(struct store_io *io, int job);

/* Read up to len bytes at off into buf with as few vfs->pread calls as the
 * file allows (one, unless the read is partial), retrying EINTR; a partial
 * read that already covers `need` bytes (the span runs past end of file) ends
 * it. Returns the bytes read (short only at end of file or on a short read)
 * or -errno. *ns gets the wall time, *calls the number of pread calls. */
int64_t store_io_read(const struct moetax_store_vfs *vfs, int fd, void *buf, uint64_t len, uint64_t need,
                      uint64_t off, uint64_t *ns, int *calls);

uint64_t store_now_ns(void); /* CLOCK_MONOTONIC */

/* io_uring reads (uring.c): a ring per thread that reads through it, up to `depth` reads in
 * flight on it. Built with liburing only (store_ring_built); without it, or when the kernel or
 * a sandbox refuses io_uring, store_ring_init fails and the caller reads with pread. */
struct store_ring;
bool store_ring_built(void);
/* A submit or a wait on r failed: nothing more goes through it (replace it). */
bool store_ring_broken(const struct store_ring *r);
/* The environment variable that makes store_ring_init fail (tests of the fallback): an errno
 * number, EPERM or ENOMEM; any other non-empty value but "0" gives ENOSYS. */
const char *store_ring_fail_env(void);
/* 0 or -errno (-ENOSYS: no io_uring in this build or kernel; -EPERM: forbidden, e.g. seccomp). */
int store_ring_init(unsigned depth, struct store_ring **out);
void store_ring_free(struct store_ring *r);
/* The streaming interface (bench io): queue a read of n bytes at off tagged `tag`, submit the
 * queued ones, wait for one completion (*res: bytes or -errno, as the kernel gives it). */
int store_ring_prep(struct store_ring *r, int fd, void *buf, size_t n, uint64_t off, uint64_t tag);
int store_ring_submit(struct store_ring *r, int *submitted); /* *submitted: SQEs the kernel took, also on failure */
int store_ring_wait(struct store_ring *r, uint64_t *tag, int *res);

#define STORE_RING_MAX_REQS 16
struct store_ring_req {
    void *buf;
    uint64_t len, need, off; /* as store_io_read's */
    int64_t res;             /* out: as store_io_read's return */
    uint64_t ns;             /* out: from the first submission to the request's end */
    int calls;               /* out: SQEs it took */
    bool done;               /* internal */
};
/* Read n (<= STORE_RING_MAX_REQS, <= the ring's depth) requests on fd, all in flight at once,
 * each with store_io_read's meaning (EINTR/EAGAIN retried, a partial read resubmitted for the
 * rest, `need` ends a span past end of file). Every completion passes through
 * vfs->uring_result when the VFS has one. Returns when all are done. */
void store_ring_read(struct store_ring *r, const struct moetax_store_vfs *vfs, int fd, struct store_ring_req *q,
                     int n);

#endif
