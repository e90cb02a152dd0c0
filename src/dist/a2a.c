/* a2a.c - the token-sharded dispatch's all-to-all exchanges and the communication thread
 * (see dist.h, "Token-sharded dispatch"). */
#include <mpi.h>
#include <stdint.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dist/dist.h"
#include "moetax/ledger.h"

enum { A2A_TAG = 7101, A2A_TAG_COUNTS = 7102 };

static moetax_status a2a_fail(const struct moetax_dist *d, int rc, const char *what) {
    char s[MPI_MAX_ERROR_STRING];
    int n = 0;
    MPI_Error_string(rc, s, &n);
    return moetax_error(MOETAX_ERR_IO, "rank %d: %s failed: %s", d->rank, what, s);
}

/* Poll the n requests req[] until all are done or d->timeout_s seconds (MOETAX_MPI_TIMEOUT; 0: no
 * limit). On the communication thread the poll sleeps between tests so that it leaves the core to
 * the compute workers (this machine runs more threads than cores). */
static moetax_status a2a_poll(struct moetax_dist *d, int n, MPI_Request *req, int il, const char *what, bool nap) {
    const double limit = d->timeout_s;
    const uint64_t t0 = moetax_ledger_now();
    int done = 0, rc = MPI_SUCCESS;
    for (int spin = 0; rc == MPI_SUCCESS;) {
        rc = MPI_Testall(n, req, &done, MPI_STATUSES_IGNORE);
        if (done || rc != MPI_SUCCESS) break;
        if (limit > 0 && (double)(moetax_ledger_now() - t0) / 1e9 > limit) {
            char late[256];
            moetax_dist_late_ranks(d, late, sizeof late);
            return moetax_error(MOETAX_ERR_IO, "rank %d of %d: waited more than %g s (MOETAX_MPI_TIMEOUT) in layer %d's "
                                "%s: rank(s) %s did not arrive", d->rank, d->size, limit, il, what, late[0] ? late : "?");
        }
        if (nap && ++spin > 64 && d->nap_ns) {
            struct timespec ts = {0, d->nap_ns};
            nanosleep(&ts, NULL);
        } else sched_yield();
    }
    return rc == MPI_SUCCESS ? MOETAX_OK : a2a_fail(d, rc, what);
}

/* The exchange itself, on the calling thread: counts (booked to wait: they complete when the
 * slowest rank has reached this exchange), then the payload (booked to comm). Self-sends are not
 * passed to MPI. Both go point to point, one message per peer and direction: the counts too,
 * where an MPI_Ialltoall of one int polled with MPI_Test, and a persistent MPIX_Alltoall_init,
 * measured slower (README, Expert parallelism). MPI_THREAD_SERIALIZED keeps every rank's
 * exchanges in one order, and messages between two ranks with one tag arrive in the order they
 * were sent, so exchange k's counts meet exchange k's receives. */
static moetax_status a2a_run(struct moetax_dist *d, struct moetax_dist_a2a *x, bool nap) {
    const int P = d->size, me = d->rank;
    moetax_dist_test_stall(d);
    uint64_t t0 = moetax_ledger_now();
    x->t_begin = t0;
    x->scount[me] = x->rcount[me] = 0;
    MPI_Request *rq = x->req;
    if (!rq) return moetax_error(MOETAX_ERR_INTERNAL, "rank %d: an exchange without requests", me);
    int rc = MPI_SUCCESS, nc = 0;
    for (int r = 0; r < P && rc == MPI_SUCCESS; r++)
        if (r != me) rc = MPI_Irecv(&x->rcount[r], 1, MPI_INT, r, A2A_TAG_COUNTS, MPI_COMM_WORLD, &rq[nc++]);
    for (int r = 0; r < P && rc == MPI_SUCCESS; r++)
        if (r != me) rc = MPI_Isend(&x->scount[r], 1, MPI_INT, r, A2A_TAG_COUNTS, MPI_COMM_WORLD, &rq[nc++]);
    moetax_status st =
        rc == MPI_SUCCESS ? a2a_poll(d, nc, rq, x->layer, x->what, nap) : a2a_fail(d, rc, "MPI_Isend/Irecv (counts)");
    uint64_t t1 = moetax_ledger_now();
    x->ns_wait = t1 - t0;
    atomic_store_explicit(&x->state, 1, memory_order_release);
    if (x->on_counts) x->on_counts(x->arg);
    if (st) return st;
    int64_t off = 0, sent = 0, end = 0;
    for (int r = 0; r < P; r++) {
        if (x->expect && x->rcount[r] != x->expect[r])
            return moetax_error(MOETAX_ERR_INTERNAL, "rank %d: layer %d's %s: %d bytes from rank %d where %d were "
                                "expected: the ranks diverged", me, x->layer, x->what, x->rcount[r], r, x->expect[r]);
        if (!x->expect) x->rdispl[r] = (int)off; /* packed in rank order; else where the caller wants them */
        off += x->rcount[r];
        sent += x->scount[r];
        if (x->rcount[r] && (int64_t)x->rdispl[r] + x->rcount[r] > end) end = (int64_t)x->rdispl[r] + x->rcount[r];
    }
    if (end > x->rcap)
        return moetax_error(MOETAX_ERR_LIMIT, "rank %d: layer %d's %s: %lld bytes arrive, the buffer holds %lld", me,
                            x->layer, x->what, (long long)end, (long long)x->rcap);
    /* the payload as one message per peer that has bytes for it (every rank is here now: the
     * counts said so). Point-to-point, not MPI_Ialltoallv: the nonblocking collective advances
     * one round per MPI_Test, and on an oversubscribed machine every round waits for both ranks
     * to be scheduled; MPI_Waitall drives the messages itself. On the communication thread the
     * requests are polled with naps instead, which leaves the core to the compute workers. */
    int nq = 0;
    for (int r = 0; r < P && rc == MPI_SUCCESS; r++)
        if (r != me && x->rcount[r])
            rc = MPI_Irecv((char *)x->rbuf + x->rdispl[r], x->rcount[r], MPI_BYTE, r, A2A_TAG, MPI_COMM_WORLD,
                           &rq[nq++]);
    for (int r = 0; r < P && rc == MPI_SUCCESS; r++)
        if (r != me && x->scount[r])
            rc = MPI_Isend((const char *)x->sbuf + x->sdispl[r], x->scount[r], MPI_BYTE, r, A2A_TAG, MPI_COMM_WORLD,
                           &rq[nq++]);
    if (rc != MPI_SUCCESS) st = a2a_fail(d, rc, "MPI_Isend/Irecv");
    else if (!nap) {
        rc = MPI_Waitall(nq, rq, MPI_STATUSES_IGNORE);
        st = rc == MPI_SUCCESS ? MOETAX_OK : a2a_fail(d, rc, "MPI_Waitall");
    } else {
        for (int spin = 0;;) {
            int done = 0;
            rc = MPI_Testall(nq, rq, &done, MPI_STATUSES_IGNORE);
            if (rc != MPI_SUCCESS || done) break;
            if (++spin > 64 && d->nap_ns) {
                struct timespec ts = {0, d->nap_ns};
                nanosleep(&ts, NULL);
            } else sched_yield();
        }
        st = rc == MPI_SUCCESS ? MOETAX_OK : a2a_fail(d, rc, "MPI_Testall");
    }
    x->ns_comm = moetax_ledger_now() - t1;
    x->bytes_sent = (uint64_t)sent;
    x->bytes_recv = (uint64_t)off;
    return st;
}

static void a2a_account(struct moetax_dist *d, const struct moetax_dist_a2a *x) {
    d->bytes_sent += x->bytes_sent;
    d->bytes_recv += x->bytes_recv;
    moetax_dist_book_layer(d, x->layer, x->t_begin, x->t_begin + x->ns_wait + x->ns_comm, x->bytes_sent, x->bytes_recv);
    d->ns_comm += x->ns_comm;
    d->ns_wait += x->ns_wait;
    d->n_collectives++;
}

void *moetax_dist_a2a_requests(const struct moetax_dist *d) {
    return calloc(2 * (size_t)d->size, sizeof(MPI_Request));
}

/* ---- the communication thread ------------------------------------------------------ */

enum { A2A_QUEUE = 8 };

struct a2a_thread {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct moetax_dist_a2a *q[A2A_QUEUE];
    int head, tail; /* q[head .. tail) pending */
    bool stop, started;
};
static struct a2a_thread g_ct = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void *a2a_main(void *arg) {
    struct moetax_dist *d = arg;
    pthread_mutex_lock(&g_ct.mu);
    for (;;) {
        while (!g_ct.stop && g_ct.head == g_ct.tail) pthread_cond_wait(&g_ct.cv, &g_ct.mu);
        if (g_ct.head == g_ct.tail) break;
        struct moetax_dist_a2a *x = g_ct.q[g_ct.head % A2A_QUEUE];
        pthread_mutex_unlock(&g_ct.mu);
        x->st = a2a_run(d, x, true);
        if (x->st) snprintf(x->why, sizeof x->why, "%s", moetax_last_error());
        atomic_store_explicit(&x->state, 2, memory_order_release);
        pthread_mutex_lock(&g_ct.mu);
        g_ct.head++;
    }
    pthread_mutex_unlock(&g_ct.mu);
    return NULL;
}

moetax_status moetax_dist_a2a(struct moetax_dist *d, struct moetax_dist_a2a *x) {
    moetax_status st = a2a_run(d, x, false);
    a2a_account(d, x);
    return st;
}

moetax_status moetax_dist_a2a_post(struct moetax_dist *d, struct moetax_dist_a2a *x) {
    atomic_store(&x->state, 0);
    pthread_mutex_lock(&g_ct.mu);
    if (!g_ct.started) {
        if (pthread_create(&g_ct.th, NULL, a2a_main, d)) {
            pthread_mutex_unlock(&g_ct.mu);
            return moetax_error(MOETAX_ERR_NOMEM, "rank %d: cannot start the communication thread", d->rank);
        }
        g_ct.started = true;
    }
    if (g_ct.tail - g_ct.head >= A2A_QUEUE) {
        pthread_mutex_unlock(&g_ct.mu);
        return moetax_error(MOETAX_ERR_INTERNAL, "rank %d: more than %d exchanges in flight", d->rank, A2A_QUEUE);
    }
    g_ct.q[g_ct.tail++ % A2A_QUEUE] = x;
    pthread_cond_signal(&g_ct.cv);
    pthread_mutex_unlock(&g_ct.mu);
    return MOETAX_OK;
}

int moetax_dist_a2a_state(const struct moetax_dist_a2a *x) {
    return atomic_load_explicit(&x->state, memory_order_acquire);
}

moetax_status moetax_dist_a2a_done(struct moetax_dist *d, struct moetax_dist_a2a *x) {
    a2a_account(d, x);
    return x->st ? moetax_error(x->st, "%s", x->why) : MOETAX_OK; /* the message, on the caller's thread */
}

moetax_status moetax_dist_allgather(struct moetax_dist *d, const void *mine, void *all, const int *bytes, int il,
                                    const char *what) {
    int64_t off = 0;
    for (int r = 0; r < d->size; r++) {
        d->displs[r] = (int)off;
        d->counts[r] = bytes[r];
        off += bytes[r];
        if (off > INT32_MAX) return moetax_error(MOETAX_ERR_LIMIT, "rank %d: layer %d's %s: more than MPI's int counts",
                                                 d->rank, il, what);
    }
    moetax_dist_test_stall(d);
    const uint64_t t0 = moetax_ledger_now();
    MPI_Request req;
    int rc = MPI_Iallgatherv(mine, bytes[d->rank], MPI_BYTE, all, d->counts, d->displs, MPI_BYTE, MPI_COMM_WORLD, &req);
    moetax_status st = rc == MPI_SUCCESS ? a2a_poll(d, 1, &req, il, what, false) : a2a_fail(d, rc, "MPI_Iallgatherv");
    d->ns_wait += moetax_ledger_now() - t0;
    d->bytes_sent += (uint64_t)bytes[d->rank] * (uint64_t)(d->size - 1);
    d->bytes_recv += (uint64_t)(off - bytes[d->rank]);
    moetax_dist_book_layer(d, il, t0, moetax_ledger_now(), (uint64_t)bytes[d->rank] * (uint64_t)(d->size - 1), (uint64_t)(off - bytes[d->rank]));
    d->n_global++;
    d->bytes_global += (uint64_t)bytes[d->rank] * (uint64_t)(d->size - 1) + (uint64_t)(off - bytes[d->rank]);
    return st;
}

moetax_status moetax_dist_gather_logits(struct moetax_dist *d, float *all, const int *n_rows, int64_t width) {
    int64_t off = 0;
    for (int r = 0; r < d->size; r++) {
        if ((int64_t)n_rows[r] * width > INT32_MAX || off > INT32_MAX)
            return moetax_error(MOETAX_ERR_LIMIT, "rank %d: %lld logits in one gather: more than MPI's int counts",
                                d->rank, (long long)((int64_t)n_rows[r] * width));
        d->counts[r] = (int)(n_rows[r] * width);
        d->displs[r] = (int)off;
        off += d->counts[r];
    }
    const uint64_t t0 = moetax_ledger_now();
    int rc = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, all, d->counts, d->displs, MPI_FLOAT, MPI_COMM_WORLD);
    d->ns_logits += moetax_ledger_now() - t0;
    d->bytes_logits += (uint64_t)(off - d->counts[d->rank]) * sizeof(float);
    return rc == MPI_SUCCESS ? MOETAX_OK : a2a_fail(d, rc, "MPI_Allgatherv (logits)");
}

void moetax_dist_a2a_stop(void) {
    pthread_mutex_lock(&g_ct.mu);
    bool started = g_ct.started;
    g_ct.stop = true;
    pthread_cond_signal(&g_ct.cv);
    pthread_mutex_unlock(&g_ct.mu);
    if (started) pthread_join(g_ct.th, NULL);
    g_ct.started = false;
    g_ct.stop = false;
}
