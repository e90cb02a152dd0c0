/*
 * server/http.h - the HTTP side of `moetax serve` (libmicrohttpd).
 *
 * DESIGN
 *   One thread (the loop) runs libmicrohttpd by external polling on its epoll
 *   set, and with it all of the HTTP side: connections are accepted, requests
 *   read, parsed and tokenized, answers and streams written there. It never
 *   touches the context: a generation request is handed to the scheduler
 *   (server/sched.h), and while its answer is being generated the connection
 *   is suspended (libmicrohttpd's suspend/resume), so that any number of
 *   requests wait without a thread each. The loop polls, besides libmicrohttpd's
 *   set: an eventfd that the scheduler writes when a request ends and when a
 *   stream that has sent all it had gets new text (sched.h: wake, want_text);
 *   the pacing's deadlines (a stream sends at most one event per interval);
 *   and the suspended connections' sockets, since libmicrohttpd watches no
 *   suspended socket: a client that goes away is noticed at once and its
 *   request cancelled (its cells freed at the next step), also during a long
 *   prefill or in the queue, when no bytes are being written. A reset
 *   (POLLHUP/POLLERR) is gone. A FIN (POLLRDHUP) is the same for a peer that
 *   closed and one that only half-closed (shutdown(SHUT_WR)) and still reads:
 *   a stream then writes one SSE comment (":"), which a closed peer answers
 *   with a reset and a half-closed one takes, and goes on; a non-streaming
 *   request, which can write nothing before its answer, takes the FIN as gone.
 *   So does, in effect, a stream whose headers have not gone yet (queued, or
 *   in its first 50 ms): resumed there, libmicrohttpd 0.9.75 reads the FIN
 *   first and closes the connection without an answer (a known gap: such a
 *   stream would have to queue its response before it suspends).
 *   A body larger than 64 KiB is parsed and tokenized by a second thread (the
 *   prep thread; linear in the body: ~60 ms for 1 MiB), the connection
 *   suspended meanwhile, so that one large prompt does not stall every stream;
 *   smaller ones in the loop. The two threads' CPU time is the HTTP side's cost
 *   (/metrics).
 *
 *   Limits: headers of more than 16 KiB or 256 lines are 431 before anything
 *   runs (http.c: so that libmicrohttpd's 48 KiB pool per connection keeps
 *   room for the answer); bodies over max_body bytes are 413 and close the
 *   connection, at once when Content-Length says so, else (chunked) as soon as
 *   the body passes the limit (http.c writes that answer itself: libmicrohttpd
 *   takes none while a body arrives);
 *   every request but GET /health and GET / (the dashboard page, which asks for
 *   the key itself) needs "Authorization: Bearer KEY" when a key is set (401
 *   otherwise); a full queue is 503 with Retry-After. A request must arrive
 *   whole within read_timeout_s (server/deadline.h: the connection is shut
 *   down otherwise, however it trickles, so max_conn slow clients cannot hold
 *   every slot); a connection idle for idle_timeout_s is closed
 *   (libmicrohttpd's connection timeout, which the time spent generating does
 *   not count towards).
 */
#ifndef MOETAX_SERVER_HTTP_H
#define MOETAX_SERVER_HTTP_H

#include <stddef.h>
#include <stdint.h>

#include "moetax/status.h"
#include "moetax/tokenizer.h"
#include "server/chat_template.h"
#include "server/sched.h"
#include "server/special_tokens.h"

struct srv_http_params {
    const char *host;          /* numeric IPv4 or IPv6 address */
    int port;                  /* 0: any free port (srv_http_port says which) */
    const char *api_key;       /* NULL: none */
    size_t max_body;           /* bytes */
    int max_conn;              /* connections at once */
    const char *model_name;    /* the id /v1/models lists */
    struct srv_sched *sched;
    const struct moetax_tokenizer *tok;
    enum srv_chat_tmpl tmpl;   /* SRV_CHAT_UNKNOWN: /v1/chat/completions is a 400 */
    const struct srv_specials *specials; /* control tokens split out of chat prompts (may be NULL) */
    int64_t default_max_tokens;
    double stream_interval_s;  /* a stream sends at most one event per interval (the text of every
                                * token since the last one); 0: an event per step. With n > 2 streams
                                * past their first token each waits n/2 intervals (at most 25 ms, or
                                * the interval where that is longer; http.c, stream_interval) */
    double read_timeout_s;     /* a request must arrive complete (headers and body) within this
                                * many seconds of its connection starting to wait for it: its
                                * accept, or the end of the previous answer (server/deadline.h);
                                * else the connection is closed. 0: no deadline */
    unsigned idle_timeout_s;   /* a connection that neither sends nor receives a byte for this many
                                * seconds (time spent generating its answer excluded) is closed.
                                * 0: never */
};

struct srv_http;
moetax_status srv_http_start(const struct srv_http_params *p, struct srv_http **out);
int srv_http_port(const struct srv_http *h);
/* Stop accepting connections (the ones open go on). */
void srv_http_quiesce(struct srv_http *h);
/* Wait (at most timeout_ms) until every connection has closed: their last
 * bytes (a stream's ending) go out before srv_http_stop closes them. */
void srv_http_drain(struct srv_http *h, int timeout_ms);
/* Close every connection and join their threads; frees h. The scheduler must have stopped
 * (srv_sched_stop) first: it pokes h's loop (srv_sched_set_pacer). */
void srv_http_stop(struct srv_http *h);

#endif
