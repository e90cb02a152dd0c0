/*
 * server/deadline.h - a deadline for each connection's request to arrive
 * complete (headers and body), however slowly it trickles in.
 *
 * DESIGN
 *   An idle timeout that every byte resets (libmicrohttpd's connection
 *   timeout) lets a client that sends one byte now and then hold a connection
 *   slot for ever; enough of them lock everyone else out (slowloris). This is
 *   the deadline nginx calls client_header_timeout / client_body_timeout and Go
 *   ReadTimeout: from the moment a connection starts waiting for a request (its
 *   accept, or the end of its previous response on a kept-alive connection) the
 *   whole request must be in within timeout_s, or the connection is shut down.
 *
 *   The HTTP layer tells the tracker what a connection does: srv_deadline_add
 *   when it opens (waiting), srv_deadline_busy once its request is complete or
 *   an answer is on its way (never cut while busy: a long generation or
 *   stream), srv_deadline_wait when the answer has gone and the next request
 *   may come (waiting again, a fresh clock), srv_deadline_remove before its
 *   socket is closed; srv_deadline_started when a request's first line has
 *   arrived, which tells a request cut short from a connection that was idle
 *   (a new one that sent nothing, a kept-alive one after its answer) in the
 *   counts. One sweeper thread sleeps until the earliest deadline
 *   and shuts down (shutdown(SHUT_RDWR), never close: the socket belongs to
 *   the HTTP layer) the sockets of the connections still waiting past it; the
 *   HTTP layer then sees end of file and closes them itself.
 *
 * INVARIANTS
 *   - One mutex guards the list and every entry's state. The sweeper shuts a
 *     socket down only while holding it and only for an entry in the list, and
 *     srv_deadline_remove takes it: so as long as the caller removes an entry
 *     before it closes the entry's socket, the sweeper never touches a
 *     descriptor number that has been closed and reused.
 *   - The list holds the waiting entries only, in the order their clocks
 *     started (a clock always starts at "now" under the mutex), so the head
 *     has the earliest deadline: a sweep looks at the expired head entries and
 *     nothing else. Busy and cut entries are outside the list.
 *   - The sweeper wakes for a deadline, for the first waiting entry after none
 *     waited, and to stop; an idle server does not wake it.
 */
#ifndef MOETAX_SERVER_DEADLINE_H
#define MOETAX_SERVER_DEADLINE_H

#include <stdbool.h>
#include <stdint.h>

#include "moetax/status.h"

struct srv_deadline;
struct srv_deadline_conn; /* one connection's entry */

/* Start the sweeper: a request must arrive complete within timeout_s (> 0) of
 * its connection starting to wait for it. */
moetax_status srv_deadline_start(double timeout_s, struct srv_deadline **out);
/* Stop and join the sweeper, free d (every entry must have been removed). */
void srv_deadline_stop(struct srv_deadline *d);

/* A new connection on socket fd, waiting for its first request from now.
 * NULL when out of memory (the connection then has no deadline). */
struct srv_deadline_conn *srv_deadline_add(struct srv_deadline *d, int fd);
/* Its request is complete, or an answer is queued: no deadline until
 * srv_deadline_wait. False when the sweeper had already shut it down (too
 * late: the caller drops the request). A NULL e is never cut: true. */
bool srv_deadline_busy(struct srv_deadline *d, struct srv_deadline_conn *e);
/* A request has begun on it (its first line is in): if it is cut now, it counts as a request cut
 * short, not as an idle connection closed. Until the next srv_deadline_wait. e may be NULL. */
void srv_deadline_started(struct srv_deadline *d, struct srv_deadline_conn *e);
/* Its answer has gone: waiting for the next request, a fresh clock from now. */
void srv_deadline_wait(struct srv_deadline *d, struct srv_deadline_conn *e);
/* Forget it (before its socket is closed); e may be NULL. */
void srv_deadline_remove(struct srv_deadline *d, struct srv_deadline_conn *e);

/* Connections shut down for missing their deadline, since the start: *n_cut with a request begun,
 * *n_idle with none. */
void srv_deadline_counts(struct srv_deadline *d, uint64_t *n_cut, uint64_t *n_idle);

#endif
