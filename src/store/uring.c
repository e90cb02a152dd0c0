/* uring.c - the expert store's io_uring read engine (liburing): a ring per
 * thread that reads, a few reads in flight on it at once. Built only with
 * liburing (MOETAX_WITH_URING); without it every ring fails to start with
 * ENOSYS and the store reads with pread (io.c). Reads keep pread's meaning:
 * a read returns its bytes or -errno, a partial read is resubmitted for the
 * rest, EINTR/EAGAIN are retried, and a partial read that already covers the
 * bytes needed (a span running past end of file) ends it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "store/store_impl.h"

#ifdef MOETAX_WITH_URING
#include <liburing.h>
#endif

bool store_ring_built(void) {
#ifdef MOETAX_WITH_URING
    return true;
#else
    return false;
#endif
}

const char *store_ring_fail_env(void) { return "MOETAX_STORE_URING_FAIL"; }

/* MOETAX_STORE_URING_FAIL=<errno name or number> makes ring set-up fail (tests of the fallback). */
static int forced_failure(void) {
    const char *v = getenv(store_ring_fail_env());
    if (!v || !*v || !strcmp(v, "0")) return 0;
    if (!strcmp(v, "EPERM")) return EPERM;
    if (!strcmp(v, "ENOMEM")) return ENOMEM;
    char *end;
    long n = strtol(v, &end, 10);
    return *end == 0 && n > 0 && n < 4096 ? (int)n : ENOSYS;
}

#ifdef MOETAX_WITH_URING

struct store_ring {
    struct io_uring ring;
    unsigned depth;
    unsigned unsubmitted; /* SQEs prepared since the last submit */
    bool broken;          /* a submit failed: nothing more goes through this ring */
};

int store_ring_init(unsigned depth, struct store_ring **out) {
    *out = NULL;
    int forced = forced_failure();
    if (forced) return -forced;
    if (depth < 1) depth = 1;
    struct store_ring *r = calloc(1, sizeof *r);
    if (!r) return -ENOMEM;
    int rc = io_uring_queue_init(depth, &r->ring, 0);
    if (rc < 0) {
        free(r);
        return rc;
    }
    r->depth = depth;
    *out = r;
    return 0;
}

void store_ring_free(struct store_ring *r) {
    if (!r) return;
    io_uring_queue_exit(&r->ring);
    free(r);
}

bool store_ring_broken(const struct store_ring *r) { return r->broken; }

int store_ring_prep(struct store_ring *r, int fd, void *buf, size_t n, uint64_t off, uint64_t tag) {
    if (r->broken) return -EIO;
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
    if (!sqe) return -EBUSY;
    io_uring_prep_read(sqe, fd, buf, (unsigned)n, off);
    io_uring_sqe_set_data64(sqe, tag);
    r->unsubmitted++;
    return 0;
}

int store_ring_submit(struct store_ring *r, int *submitted) {
    *submitted = 0;
    while (r->unsubmitted > 0) {
        int rc = io_uring_submit(&r->ring);
        if (rc == -EINTR || rc == -EAGAIN) continue;
        if (rc < 0) {
            /* prepared SQEs may still sit in the ring, pointing at buffers the caller will reuse:
             * the ring is not used again */
            r->broken = true;
            return rc;
        }
        *submitted += rc;
        r->unsubmitted = (unsigned)rc >= r->unsubmitted ? 0 : r->unsubmitted - (unsigned)rc;
    }
    return 0;
}

int store_ring_wait(struct store_ring *r, uint64_t *tag, int *res) {
    struct io_uring_cqe *cqe = NULL;
    int rc;
    do {
        rc = io_uring_wait_cqe(&r->ring, &cqe);
    } while (rc == -EINTR);
    if (rc < 0) {
        r->broken = true;
        return rc;
    }
    *tag = io_uring_cqe_get_data64(cqe);
    *res = cqe->res;
    io_uring_cqe_seen(&r->ring, cqe);
    return 0;
}

#else

struct store_ring {
    int unused;
};

int store_ring_init(unsigned depth, struct store_ring **out) {
    (void)depth;
    *out = NULL;
    int forced = forced_failure();
    return forced ? -forced : -ENOSYS;
}
void store_ring_free(struct store_ring *r) { (void)r; }
bool store_ring_broken(const struct store_ring *r) {
    (void)r;
    return true;
}
int store_ring_prep(struct store_ring *r, int fd, void *buf, size_t n, uint64_t off, uint64_t tag) {
    (void)r, (void)fd, (void)buf, (void)n, (void)off, (void)tag;
    return -ENOSYS;
}
int store_ring_submit(struct store_ring *r, int *submitted) {
    (void)r;
    *submitted = 0;
    return -ENOSYS;
}
int store_ring_wait(struct store_ring *r, uint64_t *tag, int *res) {
    (void)r, (void)tag, (void)res;
    return -ENOSYS;
}

#endif

/* The largest read one SQE asks for (the kernel caps a read near 2 GiB, like pread). */
#define RING_MAX_READ ((uint64_t)1 << 30)

/* Fail every request not done with err (or as short, after progress). */
static void fail_rest(struct store_ring_req *q, int n, const uint64_t *got, int err, uint64_t t0) {
    for (int i = 0; i < n; i++)
        if (!q[i].done) {
            q[i].res = got[i] > 0 ? (int64_t)got[i] : (int64_t)err;
            q[i].done = true;
            q[i].ns = store_now_ns() - t0;
        }
}

void store_ring_read(struct store_ring *r, const struct moetax_store_vfs *vfs, int fd, struct store_ring_req *q,
                     int n) {
    enum { MAXQ = STORE_RING_MAX_REQS };
    MOETAX_ASSERT(n >= 0 && n <= MAXQ);
    uint64_t got[MAXQ];
    bool want_sqe[MAXQ]; /* needs a (re)submission */
    int n_live = 0, in_flight = 0, err = 0;
    for (int i = 0; i < n; i++) {
        q[i].res = 0;
        q[i].calls = 0;
        q[i].ns = 0;
        q[i].done = q[i].len == 0;
        got[i] = 0;
        want_sqe[i] = !q[i].done;
        n_live += !q[i].done;
    }
    const uint64_t t0 = store_now_ns();
    while (n_live > 0 && !err) {
        int prepared = 0;
        for (int i = 0; i < n && !err; i++) {
            if (!want_sqe[i]) continue;
            uint64_t want = q[i].len - got[i];
            if (want > RING_MAX_READ) want = RING_MAX_READ;
            err = store_ring_prep(r, fd, (uint8_t *)q[i].buf + got[i], (size_t)want, q[i].off + got[i], (uint64_t)i);
            if (!err) {
                want_sqe[i] = false;
                q[i].calls++;
                prepared++;
            }
        }
        if (prepared > 0) {
            int submitted = 0;
            int rc = store_ring_submit(r, &submitted);
            /* what the kernel took before a failed submit is in flight too: the drain below waits for it */
            in_flight += rc < 0 ? submitted : prepared;
            if (rc < 0) err = rc;
        }
        if (err || in_flight == 0) break;
        /* reap one completion, resubmit what is partial */
        uint64_t tag;
        int res;
        int rc = store_ring_wait(r, &tag, &res);
        if (rc < 0) {
            err = rc;
            break;
        }
        in_flight--;
        int i = (int)tag;
        MOETAX_ASSERT(i >= 0 && i < n && !q[i].done);
        uint64_t want = q[i].len - got[i];
        if (want > RING_MAX_READ) want = RING_MAX_READ;
        ssize_t v = res;
        if (vfs && vfs->uring_result)
            v = vfs->uring_result(vfs->user, fd, (uint8_t *)q[i].buf + got[i], (size_t)want, q[i].off + got[i], v);
        bool finished = true;
        if (v == -EINTR || v == -EAGAIN) {
            finished = false; /* retried */
        } else if (v < 0) {
            q[i].res = got[i] > 0 ? (int64_t)got[i] : (int64_t)v; /* a later failure after progress reads as short */
        } else if (v == 0) {
            q[i].res = (int64_t)got[i]; /* end of file */
        } else if ((uint64_t)v > want) {
            q[i].res = -EIO;
        } else {
            got[i] += (uint64_t)v;
            q[i].res = (int64_t)got[i];
            finished = got[i] >= q[i].len || got[i] >= q[i].need; /* all, or the rest is past end of file */
        }
        if (finished) {
            q[i].done = true;
            q[i].ns = store_now_ns() - t0;
            n_live--;
        } else {
            want_sqe[i] = true;
        }
    }
    if (err) {
        /* the ring failed: the reads still in flight write into the caller's buffers, so wait for
         * them before failing everything that is not done */
        for (int tries = 0; in_flight > 0;) {
            uint64_t tag;
            int res;
            if (store_ring_wait(r, &tag, &res) == 0) {
                in_flight--;
                continue;
            }
            /* the ring cannot be waited on while the kernel may still write into the slot: the slot
             * would be given to another expert with those writes to come, so keep trying, and stop the
             * process rather than let an expert's weights be overwritten silently */
            if (++tries > 5000) {
                fprintf(stderr, "moetax: expert store: io_uring: %d reads still in flight into the store's memory "
                        "and the ring cannot be waited on: stopping\n", in_flight);
                abort();
            }
            struct timespec ms = {0, 1000000L};
            nanosleep(&ms, NULL);
        }
        fail_rest(q, n, got, err, t0);
    }
}
