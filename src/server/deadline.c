/* deadline.c - the request deadline's sweeper thread (see deadline.h). */
#include "server/deadline.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>


enum dl_state {
    DL_WAITING = 0, /* in the list: its request has not arrived complete yet */
    DL_BUSY,        /* a complete request or an answer in progress: never cut */
    DL_CUT,         /* shut down by the sweeper */
};

struct srv_deadline_conn {
    struct srv_deadline_conn *prev, *next; /* the waiting list (DL_WAITING only) */
    int fd;
    enum dl_state state;
    bool started;   /* a request's first line has arrived since it started waiting */
    double t_start; /* monotonic seconds: when it started waiting */
};

struct srv_deadline {
    pthread_mutex_t mu;
    pthread_cond_t cv;  /* on CLOCK_MONOTONIC */
    pthread_t thread;
    double timeout_s;
    struct srv_deadline_conn *head, *tail; /* waiting entries, oldest clock first */
    bool sleeping_idle; /* the sweeper waits with no deadline: a new waiting entry must wake it */
    bool stop;
    uint64_t n_cut;  /* shut down with a request begun */
    uint64_t n_idle; /* shut down with none */
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void list_push(struct srv_deadline *d, struct srv_deadline_conn *e) {
    e->prev = d->tail;
    e->next = NULL;
    if (d->tail) d->tail->next = e;
    else d->head = e;
    d->tail = e;
}

static void list_unlink(struct srv_deadline *d, struct srv_deadline_conn *e) {
    if (e->prev) e->prev->next = e->next;
    else d->head = e->next;
    if (e->next) e->next->prev = e->prev;
    else d->tail = e->prev;
    e->prev = e->next = NULL;
}

/* Caller holds mu: e starts waiting now (at the tail: its deadline is the latest). */
static void start_waiting(struct srv_deadline *d, struct srv_deadline_conn *e) {
    e->state = DL_WAITING;
    e->started = false;
    e->t_start = now_s();
    list_push(d, e);
    if (d->sleeping_idle) {
        d->sleeping_idle = false;
        pthread_cond_signal(&d->cv);
    }
}

static void *sweeper(void *arg) {
    struct srv_deadline *d = arg;
    pthread_mutex_lock(&d->mu);
    while (!d->stop) {
        const double now = now_s();
        struct srv_deadline_conn *e;
        while ((e = d->head) && e->t_start + d->timeout_s <= now) {
            list_unlink(d, e);
            e->state = DL_CUT;
            if (e->started) d->n_cut++;
            else d->n_idle++;
            /* the HTTP layer's thread for this connection wakes to end of file and closes it;
             * the descriptor is still open: it is removed from here before it is closed */
            (void)shutdown(e->fd, SHUT_RDWR);
        }
        if (!d->head) {
            d->sleeping_idle = true;
            pthread_cond_wait(&d->cv, &d->mu);
            d->sleeping_idle = false;
            continue;
        }
        const double until = d->head->t_start + d->timeout_s;
        struct timespec ts;
        ts.tv_sec = (time_t)floor(until);
        ts.tv_nsec = (long)((until - floor(until)) * 1e9);
        if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
        (void)pthread_cond_timedwait(&d->cv, &d->mu, &ts);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

moetax_status srv_deadline_start(double timeout_s, struct srv_deadline **out) {
    *out = NULL;
    if (!(timeout_s > 0)) return moetax_error(MOETAX_ERR_ARG, "the request deadline must be positive (got %g s)", timeout_s);
    struct srv_deadline *d = calloc(1, sizeof *d);
    if (!d) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    d->timeout_s = timeout_s;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* now_s's clock */
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, &ca);
    pthread_condattr_destroy(&ca);
    const int rc = pthread_create(&d->thread, NULL, sweeper, d);
    if (rc) {
        pthread_cond_destroy(&d->cv);
        pthread_mutex_destroy(&d->mu);
        free(d);
        return moetax_error(MOETAX_ERR_INTERNAL, "cannot start the request deadline's thread: %s", strerror(rc));
    }
    *out = d;
    return MOETAX_OK;
}

void srv_deadline_stop(struct srv_deadline *d) {
    if (!d) return;
    pthread_mutex_lock(&d->mu);
    d->stop = true;
    pthread_cond_signal(&d->cv);
    pthread_mutex_unlock(&d->mu);
    pthread_join(d->thread, NULL);
    MOETAX_ASSERT(!d->head); /* the HTTP layer removed every connection's entry */
    pthread_cond_destroy(&d->cv);
    pthread_mutex_destroy(&d->mu);
    free(d);
}

struct srv_deadline_conn *srv_deadline_add(struct srv_deadline *d, int fd) {
    struct srv_deadline_conn *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->fd = fd;
    pthread_mutex_lock(&d->mu);
    start_waiting(d, e);
    pthread_mutex_unlock(&d->mu);
    return e;
}

bool srv_deadline_busy(struct srv_deadline *d, struct srv_deadline_conn *e) {
    if (!e) return true;
    pthread_mutex_lock(&d->mu);
    if (e->state == DL_WAITING) {
        list_unlink(d, e);
        e->state = DL_BUSY;
    }
    const bool ok = e->state == DL_BUSY;
    pthread_mutex_unlock(&d->mu);
    return ok;
}

void srv_deadline_started(struct srv_deadline *d, struct srv_deadline_conn *e) {
    if (!e) return;
    pthread_mutex_lock(&d->mu);
    e->started = true;
    pthread_mutex_unlock(&d->mu);
}

void srv_deadline_wait(struct srv_deadline *d, struct srv_deadline_conn *e) {
    if (!e) return;
    pthread_mutex_lock(&d->mu);
    if (e->state == DL_WAITING) list_unlink(d, e); /* a fresh clock: to the tail */
    if (e->state != DL_CUT) start_waiting(d, e);
    pthread_mutex_unlock(&d->mu);
}

void srv_deadline_remove(struct srv_deadline *d, struct srv_deadline_conn *e) {
    if (!e) return;
    pthread_mutex_lock(&d->mu);
    if (e->state == DL_WAITING) list_unlink(d, e);
    pthread_mutex_unlock(&d->mu);
    free(e);
}

void srv_deadline_counts(struct srv_deadline *d, uint64_t *n_cut, uint64_t *n_idle) {
    pthread_mutex_lock(&d->mu);
    *n_cut = d->n_cut;
    *n_idle = d->n_idle;
    pthread_mutex_unlock(&d->mu);
}
