// ctest-labels: unit;threads
/* test_deadline.c - the request deadline's sweeper (src/server/deadline.h) on socket pairs:
 * a waiting connection is shut down at its deadline and not before, a busy one never, a fresh
 * wait restarts the clock, a removed one is left alone, and busy after a cut says so; a cut counts
 * as a request cut short when one had begun since the connection started waiting, else as idle. */
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "server/deadline.h"
#include "testutil.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_s(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

/* Seconds until fd sees end of file (its peer was shut down), -1 if not within limit_s. */
static double eof_after(int fd, double limit_s) {
    const double t0 = now_s();
    while (now_s() - t0 < limit_s) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, 10) > 0) {
            char b;
            const ssize_t n = recv(fd, &b, 1, MSG_DONTWAIT);
            if (n == 0) return now_s() - t0;
        }
    }
    return -1;
}

static bool open_now(int fd) {
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    return poll(&pf, 1, 0) == 0;
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    const double T = TU_UNDER_TSAN ? 0.5 : 0.25; /* the deadline */
    const double slack = TU_UNDER_TSAN ? 0.4 : 0.15;
    struct srv_deadline *d = NULL;
    CHECK(srv_deadline_start(0, &d) == MOETAX_ERR_ARG && !d);
    CHECK(srv_deadline_start(T, &d) == MOETAX_OK && d);
    int a[2], b[2], c[2], e[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, a) == 0 && socketpair(AF_UNIX, SOCK_STREAM, 0, b) == 0 &&
          socketpair(AF_UNIX, SOCK_STREAM, 0, c) == 0 && socketpair(AF_UNIX, SOCK_STREAM, 0, e) == 0);

    /* a waits (with a request begun), b turns busy, c waits again halfway (a fresh clock, and its
     * request begun before then no longer counts), e is removed */
    const double t0 = now_s();
    struct srv_deadline_conn *ea = srv_deadline_add(d, a[0]), *eb = srv_deadline_add(d, b[0]);
    struct srv_deadline_conn *ec = srv_deadline_add(d, c[0]), *ee = srv_deadline_add(d, e[0]);
    CHECK(ea && eb && ec && ee);
    srv_deadline_started(d, ea);
    srv_deadline_started(d, ec);
    CHECK(srv_deadline_busy(d, eb));
    srv_deadline_remove(d, ee);
    sleep_s(T / 2);
    CHECK(srv_deadline_busy(d, ec));
    srv_deadline_wait(d, ec);
    const double t_c = now_s();
    const double cut_a = eof_after(a[1], 2 * T + slack);
    CHECK_MSG(cut_a >= 0 && now_s() - t0 >= T - 0.01 && now_s() - t0 <= T + slack,
              "a waiting connection: end of file after %.3f s, want %.3f", now_s() - t0, T);
    CHECK_MSG(open_now(c[1]), "the connection whose clock restarted was cut with the first");
    const double cut_c = eof_after(c[1], 2 * T + slack);
    CHECK_MSG(cut_c >= 0 && now_s() - t_c >= T - 0.01 && now_s() - t_c <= T + slack,
              "a restarted clock: end of file %.3f s after the restart, want %.3f", now_s() - t_c, T);
    CHECK(!srv_deadline_busy(d, ea)); /* too late: the caller drops the request */
    srv_deadline_wait(d, ea);         /* a cut connection gets no new clock */
    uint64_t n_cut, n_idle;
    srv_deadline_counts(d, &n_cut, &n_idle);
    CHECK(n_cut == 1 && n_idle == 1);

    /* busy and removed ones were never touched */
    sleep_s(T + slack);
    CHECK(open_now(b[1]) && open_now(e[1]));
    srv_deadline_counts(d, &n_cut, &n_idle);
    CHECK(n_cut == 1 && n_idle == 1);
    /* busy, then done: it waits for its next request and is cut at that one's deadline */
    srv_deadline_wait(d, eb);
    const double t_b = now_s();
    CHECK(eof_after(b[1], 2 * T + slack) >= 0 && now_s() - t_b >= T - 0.01);
    srv_deadline_counts(d, &n_cut, &n_idle);
    CHECK(n_cut == 1 && n_idle == 2); /* no request after its answer: idle */
    srv_deadline_started(d, NULL);
    CHECK(srv_deadline_busy(d, NULL)); /* no entry (out of memory at add): never cut */
    srv_deadline_remove(d, ea);
    srv_deadline_remove(d, eb);
    srv_deadline_remove(d, ec);
    srv_deadline_remove(d, NULL);
    srv_deadline_stop(d);
    for (int i = 0; i < 2; i++) { close(a[i]); close(b[i]); close(c[i]); close(e[i]); }
    return tu_finish("test_deadline");
}
