/* http.c - libmicrohttpd glue: routes, limits, auth, streaming (see http.h). */
#include "server/http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <stdarg.h>
#include <time.h>
#include <unistd.h>

#include <microhttpd.h>

#include "server/api.h"
#include "server/dashboard.h"
#include "server/deadline.h"
#include "server/metrics.h"
#include "server/special_tokens.h"

/* A suspended connection and what it waits for (in h->waits; the loop thread's only). */
enum wait_end {
    WAIT_NONE = 0,
    WAIT_READY, /* its request has something for it (a stream's text, or the end) */
    WAIT_GONE,  /* the client went away: the connection closes */
    WAIT_PROBE, /* a stream's client sent a FIN: one SSE comment tells a close from a half-close */
};
struct wait {
    struct MHD_Connection *c;
    int fd;
    struct srv_req *r;     /* held by the stream or the connection's state, not by the wait */
    const size_t *sent;    /* a stream: bytes of r->text already out; NULL: a whole answer (waits for the end) */
    const atomic_int *prep; /* (r NULL) a request being prepared: waits for PREP_DONE */
    double wake_at;        /* a paced stream: not before this (monotonic seconds); 0: once there is text */
    double until;          /* a stream's headers: at this time even without text (0: no such time) */
    bool probed;           /* a stream's FIN was answered with a probe: from then on only a reset counts */
    enum wait_end end;     /* why it was resumed, for the callback libmicrohttpd calls next */
};

/* A connection refused while its body was still arriving (refuse_mid_body): the rest of the answer
 * goes out, then what the client still sends is read and dropped until it closes or `until`. fd is
 * a duplicate of the connection's socket, which keeps it open after libmicrohttpd closes its own. */
struct refusal {
    int fd;
    double until;
    char *out;             /* the answer's bytes not yet sent (NULL: all sent, the sending half shut) */
    size_t len, off;
};

enum { CMD_QUIESCE = 1, CMD_STOP = 2 };

struct srv_http {
    struct srv_http_params p;
    struct MHD_Daemon *d;
    int port;
    int64_t created;
    atomic_ullong next_id;
    struct srv_deadline *dl; /* the request deadline (NULL: --read-timeout 0) */
    atomic_int streams;      /* streams being written now, from their first token (stream_interval
                              * stretches with them; a request still queued does not count) */
    pthread_t loop;          /* the one thread that runs libmicrohttpd, and all of the HTTP side */
    int kick_fd;             /* eventfd: the scheduler's wake-ups (kick) and the controller's commands */
    atomic_bool kicked;      /* a kick is in kick_fd and not yet taken */
    _Atomic uint64_t pace_due; /* the earliest paced stream's wake_at in ns (UINT64_MAX: none), for the
                                * scheduler (srv_sched_set_pacer) */
    atomic_int cmd, done;    /* CMD_* asked by the controller; carried out by the loop */
    atomic_uint n_conn;      /* connections open, as the loop last counted them */
    /* the prep thread: large bodies' requests prepared off the loop (gen_prepare) */
    pthread_t prep_th;
    pthread_mutex_t prep_mu;
    pthread_cond_t prep_cv;
    struct prep *prep_head, *prep_tail; /* queued, under prep_mu */
    bool prep_stop;                     /* under prep_mu */
    atomic_ullong prep_cpu_ns;          /* the prep thread's CPU time, as of its last request */
    /* the loop thread's only */
    bool stopping;           /* CMD_STOP taken: no connection may be suspended any more */
    struct wait **waits;
    int n_waits, cap_waits;
    struct refusal *refusals;
    int n_refusals, cap_refusals;
};

static bool grow_refusals(struct srv_http *h) {
    const int cap = h->cap_refusals ? 2 * h->cap_refusals : 8;
    struct refusal *n = realloc(h->refusals, sizeof *n * (size_t)cap);
    if (!n) return false;
    h->refusals = n;
    h->cap_refusals = cap;
    return true;
}

/* Wake the loop (any thread; with a request's lock held, from the scheduler: it only writes an
 * eventfd, once until the loop has taken it). */
static void kick(void *arg) {
    struct srv_http *h = arg;
    if (atomic_exchange(&h->kicked, true)) return;
    const uint64_t one = 1;
    while (write(h->kick_fd, &one, sizeof one) < 0 && errno == EINTR) {}
}

/* Suspend w's connection until its request has something for it (w->sent: text past *w->sent, or
 * from wake_at on for a paced stream, or at until for a stream's headers; else its end) or its
 * client goes away. From a libmicrohttpd callback of that connection, in the loop thread. False
 * when the server stops (libmicrohttpd must not be stopped with a suspended connection) or out of
 * memory: nothing is suspended (send_wait_refused answers). */
static bool wait_add(struct srv_http *h, struct wait *w, double wake_at, double until) {
    if (h->stopping) return false;
    if (h->n_waits == h->cap_waits) {
        const int cap = h->cap_waits ? 2 * h->cap_waits : 16;
        struct wait **n = realloc(h->waits, sizeof *n * (size_t)cap);
        if (!n) return false;
        h->waits = n;
        h->cap_waits = cap;
    }
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(w->c, MHD_CONNECTION_INFO_CONNECTION_FD);
    w->fd = ci ? ci->connect_fd : -1;
    w->wake_at = wake_at;
    w->until = until;
    w->end = WAIT_NONE;
    h->waits[h->n_waits++] = w;
    MHD_suspend_connection(w->c);
    return true;
}

static enum MHD_Result send_error(struct MHD_Connection *c, int status, const char *msg);
/* The answer when wait_add refused: 503 while the server stops, else 500 (out of memory). */
static enum MHD_Result send_wait_refused(const struct srv_http *h, struct MHD_Connection *c) {
    return h->stopping ? send_error(c, 503, "the server is shutting down") : send_error(c, 500, "out of memory");
}

/* Per connection (con_cls): the body as it arrives. */
struct conn {
    char *body;
    size_t len, cap;
    int route;
    bool chunked;   /* Transfer-Encoding: chunked: trailers may follow the body */
    bool responded; /* a response is queued: ignore the rest of the body */
    /* a whole (not streamed) answer being generated: the connection is suspended until its end */
    struct srv_req *r; /* a reference */
    struct stream *s;  /* a stream before its first text (then its response owns it) */
    struct prep *prep; /* being prepared by the prep thread (a large body) */
    bool chat;
    char id[48];
    struct wait w;
};

enum route { R_NONE = 0, R_PAGE, R_HEALTH, R_MODELS, R_METRICS, R_TAX, R_COMPLETIONS, R_CHAT };

/* The route of (url, method); none: *status is 404, or 405 with *allow the methods the url takes. A target
 * in absolute form ("http://host/health", which RFC 9112 3.2.2 has a server accept) is routed by its
 * path. */
static int route_of(const char *url, const char *method, int *status, const char **allow) {
    const char *scheme = !strncasecmp(url, "http://", 7) ? url + 7 : !strncasecmp(url, "https://", 8) ? url + 8 : NULL;
    if (scheme) url = strchr(scheme, '/') ? strchr(scheme, '/') : "/";
    static const struct { const char *url, *method; int r; } table[] = {
        {"/", "GET", R_PAGE},                 {"/index.html", "GET", R_PAGE},
        {"/health", "GET", R_HEALTH},         {"/v1/health", "GET", R_HEALTH},
        {"/v1/models", "GET", R_MODELS},      {"/models", "GET", R_MODELS},
        {"/metrics", "GET", R_METRICS},       {"/tax", "GET", R_TAX},
        {"/v1/completions", "POST", R_COMPLETIONS},
        {"/completions", "POST", R_COMPLETIONS}, {"/v1/chat/completions", "POST", R_CHAT},
        {"/chat/completions", "POST", R_CHAT},
    };
    bool known = false;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(url, table[i].url) != 0) continue;
        known = true;
        *allow = strcmp(table[i].method, "GET") == 0 ? "GET, HEAD" : table[i].method;
        if (strcmp(method, table[i].method) == 0 || (strcmp(method, "HEAD") == 0 && strcmp(table[i].method, "GET") == 0))
            return table[i].r;
    }
    *status = known ? 405 : 404;
    return R_NONE;
}

/* How an answer goes out beyond its status and body. */
struct send_opts {
    const char *allow; /* a 405: its Allow header */
    bool close;        /* "Connection: close": the connection ends after this answer */
};

static enum MHD_Result send_text_opts(struct MHD_Connection *c, int status, const char *ctype, char *text, size_t len,
                                      struct send_opts o);
static enum MHD_Result send_text(struct MHD_Connection *c, int status, const char *ctype, char *text, size_t len) {
    return send_text_opts(c, status, ctype, text, len, (struct send_opts){0});
}

static enum MHD_Result send_text_opts(struct MHD_Connection *c, int status, const char *ctype, char *text, size_t len,
                                      struct send_opts o) {
    if (!text) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"code\":500}}";
        struct MHD_Response *r = MHD_create_response_from_buffer(sizeof oom - 1, (void *)oom, MHD_RESPMEM_PERSISTENT);
        if (!r) return MHD_NO;
        MHD_add_response_header(r, "Content-Type", "application/json");
        enum MHD_Result ok = MHD_queue_response(c, 500, r);
        MHD_destroy_response(r);
        return ok;
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
    if (!r) { free(text); return MHD_NO; }
    MHD_add_response_header(r, "Content-Type", ctype);
    if (status == 503) MHD_add_response_header(r, "Retry-After", "1");
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    if (status == 405 && o.allow) MHD_add_response_header(r, "Allow", o.allow);
    if (o.close) MHD_add_response_header(r, "Connection", "close");
    enum MHD_Result ok = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    return ok;
}

static enum MHD_Result send_json(struct MHD_Connection *c, int status, char *json) {
    return send_text(c, status, "application/json", json, json ? strlen(json) : 0);
}

static enum MHD_Result send_error(struct MHD_Connection *c, int status, const char *msg) {
    return send_json(c, status, srv_api_error_json(msg, srv_api_error_type(status), status));
}

/* An error after which the connection closes: what follows on it cannot be trusted to be a request. */
static enum MHD_Result send_error_close(struct MHD_Connection *c, int status, const char *msg) {
    char *j = srv_api_error_json(msg, srv_api_error_type(status), status);
    return send_text_opts(c, status, "application/json", j, j ? strlen(j) : 0, (struct send_opts){.close = true});
}

/* c's request deadline entry (NULL: none) */
static struct srv_deadline_conn *deadline_of(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

/* c's request is complete, or an answer to it is about to be queued: it is no longer subject
 * to the request deadline. False when the deadline has already shut it down. */
static bool request_in(struct srv_http *h, struct MHD_Connection *c) {
    return !h->dl || srv_deadline_busy(h->dl, deadline_of(c));
}

/* libmicrohttpd's memory pool per connection (its default is 32 KiB) holds the request line, the
 * headers, the read buffer, and last, once the work is done, the answer's header and chunk buffer:
 * headers that fill the pool leave no room for the answer, and the connection then closes without
 * one. So the headers are held well below the pool: 431 past either limit, their bytes or their
 * count (each header costs a list entry in the pool too). The body streams through the read buffer
 * to on_request, which keeps it outside the pool (--max-body). The pool is no larger than that needs:
 * libmicrohttpd maps it afresh for every connection and zeroes all of it after each answer on a
 * kept-alive one, so that each of its pages costs a page fault per connection (Node.js takes 16 KiB
 * of headers by default too). */
enum { SRV_MHD_POOL_BYTES = 48 << 10, SRV_MAX_HEADER_BYTES = 16 << 10, SRV_MAX_HEADERS = 256 };

/* What a request's headers add up to: libmicrohttpd keeps a list entry in the pool for every header,
 * every cookie of a Cookie header (and a copy of that header), every argument of the URL's query and
 * every trailer of a chunked body, so all of them count. */
struct head_stats {
    size_t n, bytes;            /* entries; their names' and values' bytes with ": " and CRLF */
    int n_length, n_encoding;   /* Content-Length and Transfer-Encoding headers */
    int n_auth;                 /* Authorization headers */
    const char *content_coding; /* a Content-Encoding other than identity */
    int n_bad_name;             /* header names with a space or tab ("Content-Length : 4") */
    const char *encoding;       /* the last Transfer-Encoding */
};

/* The kinds counted against the limits: the request's, and at the final call its trailers too. */
#define HEAD_KINDS (MHD_HEADER_KIND | MHD_COOKIE_KIND | MHD_GET_ARGUMENT_KIND)

static enum MHD_Result count_header(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    struct head_stats *f = cls;
    f->n++;
    f->bytes += strlen(key) + (value ? strlen(value) : 0) + 4;
    if (kind != MHD_HEADER_KIND) return MHD_YES;
    /* libmicrohttpd keeps whitespace before the colon in the name (0.9.75, by default), where it no
     * longer matches Content-Length or Transfer-Encoding; RFC 9112 5.1 makes it a 400 */
    if (strpbrk(key, " \t")) f->n_bad_name++;
    else if (strcasecmp(key, "Content-Length") == 0) f->n_length++;
    else if (strcasecmp(key, "Transfer-Encoding") == 0) { f->n_encoding++; f->encoding = value; }
    else if (strcasecmp(key, "Authorization") == 0) f->n_auth++;
    else if (strcasecmp(key, "Content-Encoding") == 0 && value && *value && strcasecmp(value, "identity") != 0)
        f->content_coding = value;
    return MHD_YES;
}

/* The 431 for entries of `kinds` past the limits (NULL: within them), into msg[cap]. */
static const char *head_limits(struct MHD_Connection *c, const char *url, int kinds, struct head_stats *f,
                               char *msg, size_t cap) {
    *f = (struct head_stats){.bytes = strlen(url)};
    MHD_get_connection_values(c, (enum MHD_ValueKind)kinds, count_header, f);
    if (f->bytes <= SRV_MAX_HEADER_BYTES && f->n <= SRV_MAX_HEADERS) return NULL;
    snprintf(msg, cap, "the request has %zu headers, cookies, query arguments and trailers of %zu bytes (with the "
             "URL): the server takes at most %d of them and %d bytes", f->n, f->bytes, SRV_MAX_HEADERS,
             SRV_MAX_HEADER_BYTES);
    return msg;
}

/* Why the request's headers are refused (NULL: they are not), with the status in *status, into
 * msg[cap]. Framing: two parties that read the body's length from different headers (a proxy in front,
 * libmicrohttpd, which takes the first Content-Length and prefers Transfer-Encoding) would see
 * different requests on the same bytes: request smuggling. RFC 9112 6.3 makes such a request an error
 * that closes the connection. */
static const char *headers_error(struct MHD_Connection *c, const char *url, int *status, char *msg, size_t cap) {
    struct head_stats f;
    *status = 431;
    if (head_limits(c, url, HEAD_KINDS, &f, msg, cap)) return msg;
    *status = 400;
    if (f.n_bad_name) return "a header name holds a space or tab (RFC 9112 5.1): the request's framing is ambiguous";
    if (f.n_length > 1) return "more than one Content-Length header: the body's length is ambiguous";
    if (f.n_length && f.n_encoding)
        return "both Content-Length and Transfer-Encoding: the body's length is ambiguous (RFC 9112 6.3)";
    if (f.n_encoding > 1) return "more than one Transfer-Encoding header";
    if (f.n_encoding && (!f.encoding || !f.encoding[0] || strchr(" \t", f.encoding[0]) ||
                         strchr(" \t", f.encoding[strlen(f.encoding) - 1])))
        return "a Transfer-Encoding header that is empty or padded with white space (send \"chunked\")";
    if (f.n_encoding && strcasecmp(f.encoding, "chunked") != 0) {
        *status = 501;
        return "Transfer-Encoding other than chunked is not supported";
    }
    if (f.n_auth > 1) return "more than one Authorization header";
    if (f.content_coding) {
        *status = 415;
        snprintf(msg, cap, "Content-Encoding %.64s is not supported: send the body uncompressed", f.content_coding);
        return msg;
    }
    return NULL;
}

static bool auth_ok(const struct srv_http *h, struct MHD_Connection *c) {
    if (!h->p.api_key) return true;
    const char *a = NULL;
    size_t len = 0;
    if (MHD_lookup_connection_value_n(c, MHD_HEADER_KIND, "Authorization", 13, &a, &len) != MHD_YES || !a) return false;
    if (len < 7 || strncasecmp(a, "Bearer ", 7) != 0 || memchr(a, 0, len)) return false;
    a += 7;
    const size_t n = len - 7, k = strlen(h->p.api_key);
    unsigned char diff = n != k;
    for (size_t i = 0; i < n && i < k; i++) diff |= (unsigned char)(a[i] ^ h->p.api_key[i]); /* constant time */
    return diff == 0;
}

/* ---- generation ------------------------------------------------------- */

struct stream {
    struct srv_http *h;
    struct MHD_Connection *c;
    struct srv_req *r;
    bool chat, include_usage, done;
    struct wait w;       /* while suspended */
    char id[48];
    size_t sent;         /* bytes of r->text sent */
    char *out;           /* pending SSE bytes */
    size_t out_len, out_off;
    double t_sent;       /* monotonic seconds of the last event with text (0: none yet) */
    bool counted;        /* in h->streams: from its first event with text (not while queued) to its last */
};

static void resp_init(const struct srv_http *h, const struct srv_req *r, bool chat, const char *id,
                      struct srv_api_resp *a) {
    memset(a, 0, sizeof *a);
    a->chat = chat;
    a->id = id;
    a->model = h->p.model_name;
    a->created = r->created;
    a->prompt_tokens = r->n_prompt;
    a->completion_tokens = r->n_gen;
    a->cached_tokens = r->n_reused;
}

static bool out_add(struct stream *s, const char *json) {
    if (!json) return false;
    const size_t n = strlen(json);
    char *o = realloc(s->out, s->out_len + n + 8);
    if (!o) return false;
    s->out = o;
    memcpy(s->out + s->out_len, "data: ", 6);
    memcpy(s->out + s->out_len + 6, json, n);
    memcpy(s->out + s->out_len + 6 + n, "\n\n", 2);
    s->out_len += n + 8;
    return true;
}

/* Fill s->out with what the request has for the client; false when there is nothing (yet),
 * and then the request's next text wakes the loop (want_text). The request's lock is held only
 * to copy what is new (the scheduler takes it for every token): the JSON is made after. The
 * last text and the end (finish chunk, usage, [DONE]) go in one event. */
static bool stream_fill(struct stream *s) {
    struct srv_req *r = s->r;
    struct srv_api_resp a;
    pthread_mutex_lock(&r->mu);
    resp_init(s->h, r, s->chat, s->id, &a);
    const enum srv_finish fin = r->finish;
    const size_t upto = r->len;
    char *text = NULL, err[sizeof r->err];
    if (upto > s->sent && (text = malloc(upto - s->sent))) memcpy(text, r->text + s->sent, upto - s->sent);
    if (fin != SRV_FINISH_NONE) snprintf(err, sizeof err, "%s", r->err[0] ? r->err : "the request ended");
    if (upto == s->sent && fin == SRV_FINISH_NONE) r->want_text = true;
    pthread_mutex_unlock(&r->mu);
    bool any = false;
    if (text) {
        a.text = text;
        a.text_len = upto - s->sent;
        char *j = srv_api_chunk_json(&a, false, false);
        any = out_add(s, j);
        free(j);
        free(text);
        if (any) { /* else (out of memory) the text stays unsent and the next fill tries again */
            s->sent = upto;
            s->t_sent = srv_now_s();
            if (!s->counted) {
                s->counted = true;
                atomic_fetch_add(&s->h->streams, 1);
            }
        }
    }
    if (fin != SRV_FINISH_NONE && s->sent == upto) { /* all the text is out (or in this event) */
        if (fin == SRV_FINISH_STOP || fin == SRV_FINISH_LENGTH) {
            a.text = "";
            a.text_len = 0;
            a.finish_reason = srv_finish_name(fin);
            char *j = srv_api_chunk_json(&a, false, false);
            out_add(s, j);
            free(j);
            if (s->include_usage) {
                j = srv_api_chunk_json(&a, false, true);
                out_add(s, j);
                free(j);
            }
        } else {
            char *j = srv_api_error_json(err, "server_error", 500);
            out_add(s, j);
            free(j);
        }
        const char done[] = "data: [DONE]\n\n";
        char *o = realloc(s->out, s->out_len + sizeof done);
        if (o) {
            s->out = o;
            memcpy(s->out + s->out_len, done, sizeof done - 1);
            s->out_len += sizeof done - 1;
        }
        s->done = true;
        any = true;
        /* no longer paced: leave the count before the client can read [DONE], so that a client
         * that reads /metrics after its stream ends sees it gone (stream_free came later) */
        if (s->counted) {
            s->counted = false;
            atomic_fetch_sub(&s->h->streams, 1);
        }
    }
    return any;
}

/* The pacing interval now: --stream-interval for one or two streams; with n > 2 streams at once
 * n/2 times that (so that all streams together send at most two events per interval, whatever
 * their number: each event is a send() and a wake-up of the client, which take cores from the
 * steps), but no more than STREAM_INTERVAL_MAX_S (or the interval itself, where that is longer). */
#define STREAM_INTERVAL_MAX_S 0.025
static double stream_interval(struct srv_http *h) {
    const double iv = h->p.stream_interval_s;
    const int n = atomic_load(&h->streams);
    if (!(iv > 0) || n <= 2) return iv;
    double x = iv * (double)n / 2;
    const double cap = iv > STREAM_INTERVAL_MAX_S ? iv : STREAM_INTERVAL_MAX_S;
    return x < cap ? x : cap;
}

static bool req_ended(struct srv_req *r) {
    pthread_mutex_lock(&r->mu);
    const bool ended = r->finish != SRV_FINISH_NONE;
    pthread_mutex_unlock(&r->mu);
    return ended;
}

/* libmicrohttpd's content reader for a stream, in the loop thread: the pending bytes, or else the
 * connection is suspended (h->waits) until its request has something for it, and 0 returned. */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    struct stream *s = cls;
    (void)pos;
    const enum wait_end end = s->w.end;
    s->w.end = WAIT_NONE;
    if (end == WAIT_GONE) {
        srv_req_cancel(s->r);
        return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    static const char probe[] = ":\n\n";
    if (end == WAIT_PROBE && max >= sizeof probe - 1) {
        /* closed, or half-closed (nc -N) and still reading? An SSE comment, which clients ignore,
         * tells: a closed peer resets the connection (WAIT_GONE next), a half-closed one takes it
         * and gets the rest of its stream. */
        memcpy(buf, probe, sizeof probe - 1);
        return (ssize_t)(sizeof probe - 1);
    }
    for (;;) {
        if (s->out_off < s->out_len) {
            size_t n = s->out_len - s->out_off;
            if (n > max) n = max;
            memcpy(buf, s->out + s->out_off, n);
            s->out_off += n;
            if (s->out_off == s->out_len) s->out_off = s->out_len = 0;
            return (ssize_t)n;
        }
        if (s->done) return MHD_CONTENT_READER_END_OF_STREAM;
        /* pacing: at most one event per interval (the first token and the end at once: an ended
         * request's rest goes now, which also keeps its resumption from suspending it again). The
         * tokens of fast steps travel together instead of waking the loop, the client and the
         * network stack once per step, which on a machine whose cores all decode takes a core
         * from the step each time. */
        const double iv = stream_interval(s->h);
        if (iv > 0 && s->t_sent > 0 && srv_now_s() < s->t_sent + iv && !req_ended(s->r))
            return wait_add(s->h, &s->w, s->t_sent + iv, 0) ? 0 : MHD_CONTENT_READER_END_WITH_ERROR;
        if (stream_fill(s)) continue;
        return wait_add(s->h, &s->w, 0, 0) ? 0 : MHD_CONTENT_READER_END_WITH_ERROR;
    }
}

static void stream_free(void *cls) {
    struct stream *s = cls;
    if (s->counted) atomic_fetch_sub(&s->h->streams, 1);
    srv_req_cancel(s->r); /* a no-op when it has finished */
    srv_req_unref(s->r);
    free(s->out);
    free(s);
}

static int64_t now_unix(void) { return (int64_t)time(NULL); }

/* How long a stream's headers wait for its first text (handle_generate). */
#define HEADERS_WAIT_S 0.05

/* A stream's request has its first text, or has ended, or its client sent a FIN or went away (after
 * the suspension handle_generate began): the answer's status and headers go out, or an error. */
static enum MHD_Result stream_start(struct srv_http *h, struct MHD_Connection *c, struct conn *cs) {
    (void)h;
    struct stream *s = cs->s;
    struct srv_req *r = s->r;
    if (s->w.end == WAIT_GONE) {
        srv_req_cancel(r);
        return MHD_NO; /* closes the connection (on_completed frees the stream) */
    }
    pthread_mutex_lock(&r->mu);
    const enum srv_finish fin = r->finish;
    const bool failed = r->len == 0 && (fin == SRV_FINISH_CANCELLED || fin == SRV_FINISH_ERROR);
    char err[sizeof r->err];
    snprintf(err, sizeof err, "%s", r->err[0] ? r->err : "the request ended");
    pthread_mutex_unlock(&r->mu);
    if (failed) return send_error(c, fin == SRV_FINISH_CANCELLED ? 503 : 500, err);
    /* a FIN before the first text (s->w.end == WAIT_PROBE) is probed by the reader's first call */
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, s, stream_free);
    if (!resp) return MHD_NO;
    cs->s = NULL; /* the response owns it now */
    MHD_add_response_header(resp, "Content-Type", "text/event-stream");
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    enum MHD_Result ok = MHD_queue_response(c, 200, resp);
    MHD_destroy_response(resp);
    return ok;
}

/* A generation request's body made into a request (not yet submitted), or the error to answer. Linear in
 * the body (JSON, the chat template, the tokenizer): done in the loop for a small body, by the prep thread
 * for a large one (see struct prep_queue), so that one large prompt does not hold up everyone's streams.
 * Thread-safe: it reads the server's parameters and the tokenizer only. */
struct prep {
    struct srv_http *h;
    char *body;            /* owned (NULL: empty) */
    size_t len;
    bool chat;
    int status;            /* 0: r is made; else the error's status and message */
    char err[512];
    struct srv_req *r;     /* a reference, not submitted */
    bool stream, include_usage;
    atomic_int state;      /* PREP_QUEUED, PREP_DONE, PREP_ABANDONED (prep_abandon) */
    struct prep *next;     /* queue link */
};
enum { PREP_QUEUED = 0, PREP_DONE, PREP_ABANDONED };

static void prep_free(struct prep *p) {
    if (!p) return;
    free(p->body);
    srv_req_unref(p->r);
    free(p);
}

static void prep_fail(struct prep *p, int status, const char *msg) {
    p->status = status;
    snprintf(p->err, sizeof p->err, "%s", msg);
}

static void gen_prepare(struct prep *p) {
    struct srv_http *h = p->h;
    const bool chat = p->chat;
    struct srv_api_req q;
    if (chat && h->p.tmpl == SRV_CHAT_UNKNOWN) {
        prep_fail(p, 400, "this model has no chat template moetax knows (tokenizer.chat_template is missing or not "
                          "recognised): use /v1/completions with a plain prompt instead");
        return;
    }
    if (srv_api_parse(p->body ? p->body : "", p->len, chat, &q, p->err, sizeof p->err)) {
        p->status = 400;
        return;
    }
    for (int i = 0; i < q.n_msgs; i++) {
        if (srv_chat_role_ok(h->p.tmpl, q.msgs[i].role)) continue;
        p->status = 400;
        snprintf(p->err, sizeof p->err, "'messages[%d].role' is \"%s\", for which the %s chat template has no turn (it "
                 "takes system, user and assistant)", i, q.msgs[i].role, srv_chat_name(h->p.tmpl));
        srv_api_req_free(&q);
        return;
    }
    char *text = q.prompt;
    size_t text_len = q.prompt_len;
    char *rendered = NULL;
    if (chat) {
        if (!(rendered = srv_chat_render(h->p.tmpl, q.msgs, q.n_msgs, true, &text_len))) {
            srv_api_req_free(&q);
            prep_fail(p, 500, "out of memory");
            return;
        }
        text = rendered;
    }
    /* a chat prompt's control tokens as single ids */
    int32_t *ids = NULL;
    int64_t n_ids = 0;
    moetax_status st = srv_encode_special(h->p.tok, chat ? h->p.specials : NULL, text, text_len,
                                          moetax_tokenizer_add_bos(h->p.tok), &ids, &n_ids);
    free(rendered);
    if (st) { srv_api_req_free(&q); prep_fail(p, 500, "cannot tokenize the prompt"); return; }
    if (n_ids == 0) { free(ids); srv_api_req_free(&q); prep_fail(p, 400, "the prompt is empty"); return; }
    struct srv_req *r = srv_req_new(ids, n_ids);
    free(ids);
    if (!r) { srv_api_req_free(&q); prep_fail(p, 500, "out of memory"); return; }
    const int64_t room = srv_sched_max_seq(h->p.sched) - n_ids;
    r->max_tokens = q.max_tokens > 0 ? q.max_tokens : (room < h->p.default_max_tokens ? room : h->p.default_max_tokens);
    r->sp = q.sp;
    r->ignore_eos = q.ignore_eos;
    if (!q.has_seed)
        r->sp.seed = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull + atomic_fetch_add(&h->next_id, 1);
    for (int i = 0; i < q.n_stop; i++) { r->stop[i] = q.stop[i]; q.stop[i] = NULL; }
    r->n_stop = q.n_stop;
    q.n_stop = 0;
    p->stream = q.stream;
    p->include_usage = q.include_usage;
    srv_api_req_free(&q);
    if (r->max_tokens < 1) {
        p->status = 400;
        snprintf(p->err, sizeof p->err, "the prompt (%lld tokens) leaves no room in the %lld positions a request may "
                 "use", (long long)n_ids, (long long)srv_sched_max_seq(h->p.sched));
        srv_req_unref(r);
        return;
    }
    p->r = r;
}

/* Submit a prepared request (in the loop) and begin its answer: p->r passes to the answer. */
static enum MHD_Result gen_submit(struct srv_http *h, struct MHD_Connection *c, struct conn *cs, struct prep *p) {
    char err[512];
    if (p->status) return send_error(c, p->status, p->err);
    struct srv_req *r = p->r;
    p->r = NULL;
    const bool chat = p->chat, stream = p->stream, include_usage = p->include_usage;
    r->wake = kick; /* the request's end, and a waiting stream's text, wake the loop */
    r->wake_arg = h;
    moetax_status st = srv_sched_submit(h->p.sched, r);
    if (st) {
        snprintf(err, sizeof err, "%s", moetax_last_error());
        srv_req_unref(r);
        return send_error(c, st == MOETAX_ERR_LIMIT ? 503 : 400, err);
    }
    char id[48];
    snprintf(id, sizeof id, "%s-%llu", chat ? "chatcmpl" : "cmpl", (unsigned long long)atomic_fetch_add(&h->next_id, 1));
    if (stream) {
        struct stream *s = calloc(1, sizeof *s);
        if (!s) { srv_req_cancel(r); srv_req_unref(r); return send_error(c, 500, "out of memory"); }
        *s = (struct stream){.h = h, .c = c, .r = r, .chat = chat, .include_usage = include_usage};
        s->w = (struct wait){.c = c, .r = r, .sent = &s->sent};
        snprintf(s->id, sizeof s->id, "%s", id);
        if (chat) { /* OpenAI's first chunk: the role */
            struct srv_api_resp a;
            pthread_mutex_lock(&r->mu);
            resp_init(h, r, true, s->id, &a);
            pthread_mutex_unlock(&r->mu);
            a.text = "";
            char *j = srv_api_chunk_json(&a, true, false);
            out_add(s, j);
            free(j);
        }
        cs->s = s;
        /* the status line and headers wait for the first text, for at most HEADERS_WAIT_S: they go out
         * with it (libmicrohttpd's two sends back to back: one wake-up of the client and of this loop
         * instead of two at different times), and a request that ends before any text (cancelled,
         * failed) is answered with an error status instead of an event stream; a request that waits
         * longer (queued, a long prefill) gets its headers alone */
        pthread_mutex_lock(&r->mu);
        const bool ready = r->len > 0 || r->finish != SRV_FINISH_NONE;
        if (!ready) r->want_text = true;
        pthread_mutex_unlock(&r->mu);
        if (ready) return stream_start(h, c, cs);
        if (!wait_add(h, &s->w, 0, srv_now_s() + HEADERS_WAIT_S)) {
            srv_req_cancel(r);
            return send_wait_refused(h, c);
        }
        return MHD_YES;
    }
    /* the connection sleeps until the end (whole_done), or until its client goes away: nothing can
     * be written before the answer's status line, so a FIN cannot be told from a close there, and a
     * client that half-closes is taken as gone (as Go's net/http and hyper do) */
    cs->r = r;
    cs->chat = chat;
    snprintf(cs->id, sizeof cs->id, "%s", id);
    cs->w = (struct wait){.c = c, .r = r};
    if (!wait_add(h, &cs->w, 0, 0)) {
        srv_req_cancel(r);
        return send_wait_refused(h, c);
    }
    return MHD_YES;
}

/* Bodies up to this size are prepared in the loop; larger ones by the prep thread (parsing and
 * tokenizing a 1 MiB prompt takes ~60 ms on the project's VM: that long, every stream would stall). */
#define PREP_INLINE_BYTES (64 << 10)

/* The loop gives up on p (its connection closes): whoever sees the other side's mark frees it. */
static void prep_abandon(struct prep *p) {
    if (atomic_exchange(&p->state, PREP_ABANDONED) == PREP_DONE) prep_free(p);
}

static void *prep_main(void *arg) {
    struct srv_http *h = arg;
    struct timespec ts;
    pthread_mutex_lock(&h->prep_mu);
    for (;;) {
        while (!h->prep_head && !h->prep_stop) pthread_cond_wait(&h->prep_cv, &h->prep_mu);
        struct prep *p = h->prep_head;
        if (!p) break; /* stopping, and nothing is left */
        h->prep_head = p->next;
        if (!h->prep_head) h->prep_tail = NULL;
        const bool stop = h->prep_stop;
        pthread_mutex_unlock(&h->prep_mu);
        if (!stop && atomic_load(&p->state) != PREP_ABANDONED) gen_prepare(p);
        if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0)
            atomic_store(&h->prep_cpu_ns, (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec);
        if (atomic_exchange(&p->state, PREP_DONE) == PREP_ABANDONED) prep_free(p);
        else kick(h);
        pthread_mutex_lock(&h->prep_mu);
    }
    pthread_mutex_unlock(&h->prep_mu);
    return NULL;
}

static enum MHD_Result handle_generate(struct srv_http *h, struct MHD_Connection *c, struct conn *cs, bool chat) {
    struct prep *p = calloc(1, sizeof *p);
    if (!p) return send_error(c, 500, "out of memory");
    *p = (struct prep){.h = h, .body = cs->body, .len = cs->len, .chat = chat};
    cs->body = NULL;
    cs->len = cs->cap = 0;
    if (p->len <= PREP_INLINE_BYTES) {
        gen_prepare(p);
        const enum MHD_Result ok = gen_submit(h, c, cs, p);
        prep_free(p);
        return ok;
    }
    atomic_init(&p->state, PREP_QUEUED);
    cs->prep = p;
    cs->w = (struct wait){.c = c, .prep = &p->state};
    if (!wait_add(h, &cs->w, 0, 0)) {
        cs->prep = NULL;
        prep_free(p);
        return send_wait_refused(h, c);
    }
    pthread_mutex_lock(&h->prep_mu);
    if (h->prep_tail) h->prep_tail->next = p;
    else h->prep_head = p;
    h->prep_tail = p;
    pthread_cond_signal(&h->prep_cv);
    pthread_mutex_unlock(&h->prep_mu);
    return MHD_YES;
}

/* A connection whose request the prep thread prepared, resumed: submit it, or the client has gone. */
static enum MHD_Result prep_done(struct srv_http *h, struct MHD_Connection *c, struct conn *cs) {
    struct prep *p = cs->prep;
    cs->prep = NULL;
    if (cs->w.end == WAIT_GONE) {
        prep_abandon(p);
        return MHD_NO; /* closes the connection */
    }
    const enum MHD_Result ok = gen_submit(h, c, cs, p);
    prep_free(p);
    return ok;
}

/* A whole answer's connection, resumed: its request has ended, or its client has gone. */
static enum MHD_Result whole_done(struct srv_http *h, struct MHD_Connection *c, struct conn *cs) {
    struct srv_req *r = cs->r;
    if (cs->w.end == WAIT_GONE) {
        srv_req_cancel(r);
        return MHD_NO; /* closes the connection (on_completed drops the request) */
    }
    pthread_mutex_lock(&r->mu);
    if (r->finish == SRV_FINISH_NONE) { /* not reached: the loop resumes it only at the end */
        pthread_mutex_unlock(&r->mu);
        srv_req_cancel(r);
        return send_error(c, 500, "internal error: an answer was resumed before its end");
    }
    enum MHD_Result ok;
    if (r->finish == SRV_FINISH_STOP || r->finish == SRV_FINISH_LENGTH) {
        struct srv_api_resp a;
        resp_init(h, r, cs->chat, cs->id, &a);
        a.text = r->text;
        a.text_len = r->len;
        a.finish_reason = srv_finish_name(r->finish);
        char *j = srv_api_response_json(&a);
        pthread_mutex_unlock(&r->mu);
        ok = send_json(c, 200, j);
    } else {
        char err[sizeof r->err];
        snprintf(err, sizeof err, "%s", r->err[0] ? r->err : "the request ended");
        const bool cancelled = r->finish == SRV_FINISH_CANCELLED;
        pthread_mutex_unlock(&r->mu);
        ok = send_error(c, cancelled ? 503 : 500, err);
    }
    return ok;
}

/* ---- routes ----------------------------------------------------------- */

static enum MHD_Result handle_models(struct srv_http *h, struct MHD_Connection *c) {
    json_t *o = json_pack("{s:s,s:[{s:s,s:s,s:I,s:s,s:{s:I,s:i,s:s}}]}", "object", "list", "data", "id", h->p.model_name,
                          "object", "model", "created", (json_int_t)h->created, "owned_by", "moetax", "meta", "n_ctx",
                          (json_int_t)srv_sched_max_seq(h->p.sched), "n_parallel", srv_sched_n_parallel(h->p.sched),
                          "chat_template", srv_chat_name(h->p.tmpl));
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return send_json(c, 200, s);
}

static enum MHD_Result handle_metrics(struct srv_http *h, struct MHD_Connection *c) {
    struct srv_metrics m;
    srv_sched_metrics(h->p.sched, &m);
    if (h->dl) srv_deadline_counts(h->dl, &m.http_read_timeouts, &m.http_idle_closed);
    struct timespec ts; /* the HTTP side runs in this thread, the loop, and the prep thread */
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) m.http_cpu_s = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    m.http_cpu_s += (double)atomic_load(&h->prep_cpu_ns) * 1e-9; /* and the prep thread's */
    m.http_streams = atomic_load(&h->streams);
    m.http_stream_interval_s = stream_interval(h);
    size_t n = 0;
    char *t = srv_metrics_text(&m, &n);
    return send_text(c, 200, "text/plain; version=0.0.4", t, n);
}

/* GET /tax[?window=SECONDS]: the bill over the last window (default 60 s, 1..3600) as JSON */
static enum MHD_Result handle_tax(struct srv_http *h, struct MHD_Connection *c) {
    const char *w = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "window");
    double window = 60;
    if (w) {
        char *end = NULL;
        window = strtod(w, &end);
        if (!end || *end || !(window >= 1 && window <= 3600))
            return send_error(c, 400, "window: expected seconds from 1 to 3600");
    }
    return send_json(c, 200, srv_sched_tax_json(h->p.sched, window));
}

/* How long refuse_mid_body reads and drops what the client still sends after its answer. */
enum { LINGER_MS = 1000 };

/* An error answered while the body is still arriving, and the connection closed. libmicrohttpd (0.9.75)
 * takes an answer only with the headers or once the request is whole, so this one is written to the
 * socket here, with "Connection: close"; then the sending half is shut and what the client still sends
 * is read and dropped until it closes, for at most LINGER_MS (a close with unread bytes sends a reset,
 * which can destroy the answer before the client has read it); MHD_NO closes libmicrohttpd's side at
 * once. What cannot be sent at once, and the dropping, go on in the loop on a duplicate of the socket
 * (h->refusals), so that no other connection waits for this one. */
static enum MHD_Result refuse_mid_body(struct srv_http *h, struct MHD_Connection *c, int status, const char *msg) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci || !request_in(h, c)) return MHD_NO;
    const int fd = ci->connect_fd;
    char *j = srv_api_error_json(msg, srv_api_error_type(status), status);
    const char *reason = MHD_get_reason_phrase_for((unsigned)status);
    char *out = NULL, date[64] = "";
    const time_t now = time(NULL);
    struct tm tm;
    if (gmtime_r(&now, &tm)) strftime(date, sizeof date, "%a, %d %b %Y %H:%M:%S GMT", &tm); /* C locale */
    const int n = asprintf(&out, "HTTP/1.1 %d %s\r\nDate: %s\r\nContent-Type: application/json\r\n"
                           "Content-Length: %zu\r\nConnection: close\r\n\r\n%s", status,
                           reason && *reason ? reason : "Error", date, j ? strlen(j) : 0, j ? j : "");
    free(j);
    if (n <= 0) return MHD_NO;
    size_t off = 0;
    while (off < (size_t)n) {
        const ssize_t w = send(fd, out + off, (size_t)n - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) off += (size_t)w;
        else if (w < 0 && errno == EINTR) continue;
        else break;
    }
    if (off == (size_t)n) {
        free(out);
        out = NULL;
        (void)shutdown(fd, SHUT_WR);
    }
    /* Not all of it went (a full send buffer): the rest waits for POLLOUT in the loop, but the MHD_NO
     * below makes libmicrohttpd 0.9.75 shut the socket's sending half as it closes, so that rest is
     * lost (refusal_step drops it at the first EPIPE). Not seen in tests: the answer is a few hundred
     * bytes. */
    const int dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup_fd < 0 || (h->n_refusals == h->cap_refusals && !grow_refusals(h))) {
        if (dup_fd >= 0) close(dup_fd);
        free(out); /* the answer is lost only when out of descriptors or memory */
        return MHD_NO;
    }
    h->refusals[h->n_refusals++] = (struct refusal){.fd = dup_fd, .until = srv_now_s() + LINGER_MS / 1000.0,
                                                 .out = out, .len = (size_t)n, .off = off};
    return MHD_NO;
}

/* The 413's message, into msg[cap]. */
static const char *too_big_msg(const struct srv_http *h, char *msg, size_t cap) {
    snprintf(msg, cap, "the body is larger than the server's limit of %zu bytes (--max-body)", h->p.max_body);
    return msg;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    struct srv_http *h = cls;
    (void)version;
    struct conn *cs = *con_cls;
    if (!cs) { /* headers only: decide what can be decided now */
        int status = 0;
        const char *allow = NULL;
        const int route = route_of(url, method, &status, &allow);
        if (!(cs = calloc(1, sizeof *cs))) return MHD_NO;
        *con_cls = cs;
        cs->route = route;
        cs->responded = true; /* unless it goes on below */
        int head_status;
        char head_msg[256];
        const char *head_err = headers_error(c, url, &head_status, head_msg, sizeof head_msg);
        if (head_err) return request_in(h, c) ? send_error_close(c, head_status, head_err) : MHD_NO;
        cs->chunked = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Transfer-Encoding") != NULL; /* chunked */
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        const bool denied = route != R_NONE && route != R_HEALTH && route != R_PAGE && !auth_ok(h, c);
        const bool over = cl && strtoull(cl, NULL, 10) > h->p.max_body;
        /* answered from the headers alone (libmicrohttpd reads no more of the request): the answer
         * is on its way, which the request deadline must not cut */
        if ((route == R_NONE || denied || over) && !request_in(h, c)) return MHD_NO;
        if (route == R_NONE && status == 405) {
            char msg[96];
            snprintf(msg, sizeof msg, "method not allowed (this endpoint takes %s)", allow);
            char *j = srv_api_error_json(msg, srv_api_error_type(405), 405);
            return send_text_opts(c, 405, "application/json", j, j ? strlen(j) : 0, (struct send_opts){.allow = allow});
        }
        if (route == R_NONE) return send_error(c, status, "no such endpoint");
        if (denied) return send_error(c, 401, "a valid API key is required: send \"Authorization: Bearer KEY\"");
        if (over) {
            char msg[160];
            return send_error(c, 413, too_big_msg(h, msg, sizeof msg));
        }
        cs->responded = false;
        return MHD_YES;
    }
    /* resumed: the answer is ready (or a stream's first text), or the client gone */
    if (cs->prep) return prep_done(h, c, cs);
    if (cs->r) return whole_done(h, c, cs);
    if (cs->s) return stream_start(h, c, cs);
    if (cs->responded) { *upload_size = 0; return MHD_YES; }
    if (*upload_size) {
        if (cs->len + *upload_size > h->p.max_body) { /* a chunked body (a Content-Length was checked above) */
            char msg[160];
            cs->responded = true;
            return refuse_mid_body(h, c, 413, too_big_msg(h, msg, sizeof msg));
        }
        if (cs->len + *upload_size + 1 > cs->cap) {
            size_t cap = (cs->len + *upload_size + 1) * 2;
            if (cap > h->p.max_body + 1) cap = h->p.max_body + 1;
            char *b = realloc(cs->body, cap);
            if (!b) return MHD_NO;
            cs->body = b;
            cs->cap = cap;
        }
        memcpy(cs->body + cs->len, upload, *upload_size);
        cs->len += *upload_size;
        cs->body[cs->len] = 0;
        *upload_size = 0;
        return MHD_YES;
    }
    /* the whole request is in (the final call): from here no deadline cuts it */
    if (!request_in(h, c)) return MHD_NO;
    cs->responded = true;
    if (cs->chunked) { /* a chunked body's trailers take pool space as headers do */
        struct head_stats f;
        char msg[256];
        if (head_limits(c, url, HEAD_KINDS | MHD_FOOTER_KIND, &f, msg, sizeof msg))
            return send_error_close(c, 431, msg);
    }
    switch (cs->route) {
    case R_HEALTH: return send_json(c, 200, strdup("{\"status\":\"ok\"}"));
    case R_PAGE: {
        size_t n;
        const char *page = srv_dashboard_html(&n);
        struct MHD_Response *r = MHD_create_response_from_buffer(n, (void *)page, MHD_RESPMEM_PERSISTENT);
        if (!r) return MHD_NO;
        MHD_add_response_header(r, "Content-Type", "text/html; charset=utf-8");
        enum MHD_Result ok = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ok;
    }
    case R_MODELS: return handle_models(h, c);
    case R_METRICS: return handle_metrics(h, c);
    case R_TAX: return handle_tax(h, c);
    case R_COMPLETIONS: return handle_generate(h, c, cs, false);
    case R_CHAT: return handle_generate(h, c, cs, true);
    default: return send_error(c, 404, "no such endpoint");
    }
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    struct srv_http *h = cls;
    (void)toe;
    /* the answer has gone (or the connection is closing): a kept-alive connection waits for its
     * next request, which gets a deadline of its own */
    if (h->dl) srv_deadline_wait(h->dl, deadline_of(c));
    struct conn *cs = *con_cls;
    if (!cs) return;
    if (cs->r) {
        srv_req_cancel(cs->r); /* a no-op when it has finished */
        srv_req_unref(cs->r);
    }
    if (cs->s) stream_free(cs->s); /* a stream whose answer never began */
    if (cs->prep) prep_abandon(cs->prep);
    free(cs->body);
    free(cs);
    *con_cls = NULL;
}

/* Connections open and close (libmicrohttpd's NOTIFY_CONNECTION; registered with a request
 * deadline only), in the loop thread. 0.9.75 calls CLOSED before it closes the socket
 * (MHD_cleanup_connections, and new_connection_process_'s failure path): so the entry leaves
 * the deadline's list while its descriptor is still this connection's (see deadline.h). */
static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    struct srv_http *h = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        *socket_context = ci ? srv_deadline_add(h->dl, ci->connect_fd) : NULL;
    } else if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
        srv_deadline_remove(h->dl, *socket_context);
        *socket_context = NULL;
    }
}

/* A request's first line has arrived (libmicrohttpd's URI logger; registered with a request deadline
 * only): a cut from here on is a request cut short, not an idle connection closed. Its result is the
 * request's first con_cls, which on_request expects NULL. */
static void *on_request_line(void *cls, const char *uri, struct MHD_Connection *c) {
    struct srv_http *h = cls;
    (void)uri;
    srv_deadline_started(h->dl, deadline_of(c));
    return NULL;
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    if (getenv("MOETAX_SERVE_DEBUG")) vfprintf(stderr, fmt, ap);
}

/* ---- the loop ------------------------------------------------------------ */

/* Whether w's request has something for it now (w->end = WAIT_READY). A stream that has caught up
 * asks for the request's next text (want_text), which kicks the loop. */
static bool wait_ready(struct wait *w, double now) {
    if (w->prep) return atomic_load(w->prep) == PREP_DONE;
    struct srv_req *r = w->r;
    bool ready;
    pthread_mutex_lock(&r->mu);
    if (r->finish != SRV_FINISH_NONE) ready = true;
    else if (!w->sent) ready = false;                         /* a whole answer */
    else if (w->until > 0 && now >= w->until) ready = true;   /* a stream's headers */
    else if (w->wake_at > now) ready = false;                 /* a paced stream */
    else if (r->len > *w->sent) ready = true;
    else {
        r->want_text = true;
        w->wake_at = 0;
        ready = false;
    }
    pthread_mutex_unlock(&r->mu);
    return ready;
}

/* A lingering refusal's turn: send the rest of its answer, drop what the client sends. False
 * when it is over (its descriptor closed). */
static bool refusal_step(struct refusal *l, short revents, double now) {
    if (l->out && (revents & POLLOUT)) {
        bool lost = false;
        while (l->off < l->len) {
            const ssize_t w = send(l->fd, l->out + l->off, l->len - l->off, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w > 0) l->off += (size_t)w;
            else if (w < 0 && errno == EINTR) continue;
            else {
                /* EPIPE and the like: the socket's sending half is shut (libmicrohttpd shuts it when it
                 * closes its descriptor) and stays writable to poll, so keeping the rest would spin */
                lost = w < 0 && errno != EAGAIN && errno != EWOULDBLOCK;
                break;
            }
        }
        if (lost) {
            free(l->out);
            l->out = NULL;
        } else if (l->off == l->len) {
            free(l->out);
            l->out = NULL;
            (void)shutdown(l->fd, SHUT_WR);
        }
    }
    bool over = now >= l->until || (revents & (POLLERR | POLLNVAL));
    if (!over && (revents & (POLLIN | POLLHUP))) {
        for (;;) {
            char drop[4096];
            const ssize_t n = recv(l->fd, drop, sizeof drop, MSG_DONTWAIT);
            if (n > 0) continue;
            if (n < 0 && errno == EINTR) continue;
            if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) over = true;
            break;
        }
    }
    if (!over) return true;
    free(l->out);
    close(l->fd);
    return false;
}

/* Resume every suspended connection as gone, its request cancelled (the server stops). */
static void waits_cancel_all(struct srv_http *h) {
    for (int i = 0; i < h->n_waits; i++) {
        struct wait *w = h->waits[i];
        if (w->r) srv_req_cancel(w->r);
        w->end = WAIT_GONE;
        MHD_resume_connection(w->c);
    }
    h->n_waits = 0;
}

/* The HTTP side's one thread: libmicrohttpd's events (external polling on its epoll set), the
 * suspended connections' sockets (a client that goes away, or half-closes), the kicks (a request
 * has text or has ended), the pacing's deadlines, the lingering refusals, and the controller's
 * commands. All of the HTTP side runs here, so that one thread's CPU time is its cost. */
#define PACE_SLACK_S 0.002
static void *loop_main(void *arg) {
    struct srv_http *h = arg;
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_EPOLL_FD);
    const int mhd_fd = di ? di->epoll_fd : -1;
    struct pollfd *pf = NULL;
    size_t cap_pf = 0;
    for (;;) {
        const int cmd = atomic_load(&h->cmd);
        if ((cmd & CMD_QUIESCE) && !(atomic_load(&h->done) & CMD_QUIESCE)) {
            const MHD_socket fd = MHD_quiesce_daemon(h->d);
            if (fd != MHD_INVALID_SOCKET) close(fd);
            atomic_fetch_or(&h->done, CMD_QUIESCE);
        }
        if (cmd & CMD_STOP) {
            h->stopping = true; /* the run below suspends nothing more (a stream then ends cut) */
            waits_cancel_all(h);
            MHD_run(h->d);
            for (int i = 0; i < h->n_refusals; i++) { free(h->refusals[i].out); close(h->refusals[i].fd); }
            h->n_refusals = 0;
            break;
        }
        const int n_w = h->n_waits; /* the waits polled this time (more come during MHD_run) */
        const size_t n_pf = 2 + (size_t)n_w + (size_t)h->n_refusals;
        if (n_pf > cap_pf) {
            struct pollfd *np = realloc(pf, sizeof *np * n_pf * 2);
            if (!np) { /* out of memory: poll only libmicrohttpd and the kicks for a while */
                struct pollfd two[2] = {{.fd = mhd_fd, .events = POLLIN}, {.fd = h->kick_fd, .events = POLLIN}};
                (void)poll(two, 2, 10);
                MHD_run(h->d);
                continue;
            }
            pf = np;
            cap_pf = n_pf * 2;
        }
        double now = srv_now_s(), until = INFINITY, pace = INFINITY;
        MHD_UNSIGNED_LONG_LONG to;
        pf[0] = (struct pollfd){.fd = mhd_fd, .events = POLLIN};
        pf[1] = (struct pollfd){.fd = h->kick_fd, .events = POLLIN};
        for (int i = 0; i < h->n_waits; i++) {
            const struct wait *w = h->waits[i];
            if (w->wake_at > 0 && w->wake_at < pace) pace = w->wake_at;
            if (w->until > 0 && w->until < until) until = w->until;
            /* POLLRDHUP: the client's FIN; once a stream's probe has gone, only a reset counts
             * (POLLHUP and POLLERR come whatever the events) */
            pf[2 + i] = (struct pollfd){.fd = w->fd, .events = w->probed ? 0 : POLLRDHUP};
        }
        /* a paced event: the scheduler wakes the loop for it at the end of the first step past it
         * (srv_sched_set_pacer), between two steps; the loop's own timer, PACE_SLACK_S later, is for
         * steps longer than that (or none) */
        atomic_store_explicit(&h->pace_due, pace < INFINITY ? (uint64_t)(pace * 1e9) : UINT64_MAX, memory_order_relaxed);
        if (pace + PACE_SLACK_S < until) until = pace + PACE_SLACK_S;
        if (MHD_get_timeout(h->d, &to) == MHD_YES && now + (double)to * 1e-3 < until) until = now + (double)to * 1e-3;
        for (int i = 0; i < h->n_refusals; i++) {
            const struct refusal *l = &h->refusals[i];
            if (l->until < until) until = l->until;
            pf[2 + n_w + i] = (struct pollfd){.fd = l->fd, .events = (short)(POLLIN | (l->out ? POLLOUT : 0))};
        }
        struct timespec ts, *tsp = NULL;
        if (until < INFINITY) {
            double left = until - now;
            if (left < 0) left = 0;
            ts.tv_sec = (time_t)left;
            ts.tv_nsec = (long)((left - (double)ts.tv_sec) * 1e9);
            tsp = &ts;
        }
        if (ppoll(pf, n_pf, tsp, NULL) < 0 && errno != EINTR) {
            fprintf(stderr, "moetax serve: the HTTP loop's poll failed: %s\n", strerror(errno));
            struct timespec pause = {0, 10 * 1000000L};
            nanosleep(&pause, NULL);
        }
        if (pf[1].revents & POLLIN) {
            uint64_t v;
            (void)read(h->kick_fd, &v, sizeof v); /* then the flag: a kick after this writes again */
            atomic_store(&h->kicked, false);
        }
        now = srv_now_s();
        int kept = 0;
        for (int i = 0; i < n_w; i++) {
            struct wait *w = h->waits[i];
            const short re = pf[2 + i].revents;
            enum wait_end end = WAIT_NONE;
            if (re & (POLLHUP | POLLERR | POLLNVAL)) end = WAIT_GONE;
            else if (re & POLLRDHUP) end = w->sent && !w->probed ? WAIT_PROBE : WAIT_GONE;
            else if (wait_ready(w, now)) end = WAIT_READY;
            if (end == WAIT_NONE) { h->waits[kept++] = w; continue; }
            if (end == WAIT_PROBE) w->probed = true;
            w->end = end;
            MHD_resume_connection(w->c);
        }
        h->n_waits = kept;
        kept = 0;
        for (int i = 0; i < h->n_refusals; i++)
            if (refusal_step(&h->refusals[i], pf[2 + n_w + i].revents, now))
                h->refusals[kept++] = h->refusals[i];
        h->n_refusals = kept;
        MHD_run(h->d);
        const union MHD_DaemonInfo *ni = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
        if (ni) atomic_store(&h->n_conn, ni->num_connections);
    }
    free(pf);
    return NULL;
}

/* Stop and join the prep thread: it frees what is left in its queue unprepared. */
static void prep_stop(struct srv_http *h) {
    pthread_mutex_lock(&h->prep_mu);
    h->prep_stop = true;
    pthread_cond_signal(&h->prep_cv);
    pthread_mutex_unlock(&h->prep_mu);
    pthread_join(h->prep_th, NULL);
    pthread_mutex_destroy(&h->prep_mu);
    pthread_cond_destroy(&h->prep_cv);
}

moetax_status srv_http_start(const struct srv_http_params *p, struct srv_http **out) {
    *out = NULL;
    struct srv_http *h = calloc(1, sizeof *h);
    if (!h) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    h->p = *p;
    h->created = now_unix();
    atomic_init(&h->next_id, 1);
    struct sockaddr_storage ss = {0};
    /* external polling (the loop thread, loop_main) on libmicrohttpd's epoll set */
    unsigned flags = MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    struct sockaddr_in *v4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&ss;
    if (inet_pton(AF_INET, p->host, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons((uint16_t)p->port);
    } else if (inet_pton(AF_INET6, p->host, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons((uint16_t)p->port);
        flags |= MHD_USE_IPv6;
    } else {
        free(h);
        return moetax_error(MOETAX_ERR_ARG, "--host %s: not a numeric IPv4 or IPv6 address", p->host);
    }
    if (p->read_timeout_s > 0) {
        moetax_status st = srv_deadline_start(p->read_timeout_s, &h->dl);
        if (st) { free(h); return st; }
    }
    /* the logger first (libmicrohttpd warns otherwise, and reports what goes wrong with the options
     * before it on stderr); the connection notifications and the request line's only with a deadline
     * (an absent option ends the list early) */
    h->d = MHD_start_daemon(flags, (uint16_t)p->port, NULL, NULL, on_request, h, MHD_OPTION_EXTERNAL_LOGGER,
                            on_mhd_log, h, MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)SRV_MHD_POOL_BYTES,
                            MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss, MHD_OPTION_CONNECTION_LIMIT,
                            (unsigned)p->max_conn, MHD_OPTION_CONNECTION_TIMEOUT, p->idle_timeout_s,
                            MHD_OPTION_NOTIFY_COMPLETED,
                            on_completed, h, h->dl ? MHD_OPTION_NOTIFY_CONNECTION : MHD_OPTION_END, on_connection, h,
                            MHD_OPTION_URI_LOG_CALLBACK, on_request_line, h, MHD_OPTION_END);
    if (!h->d) {
        const int e = errno;
        srv_deadline_stop(h->dl);
        free(h);
        return moetax_error(MOETAX_ERR_IO, "cannot listen on %s port %d: %s", p->host, p->port, strerror(e));
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    h->port = di ? di->port : p->port;
    atomic_init(&h->kicked, false);
    atomic_init(&h->pace_due, UINT64_MAX);
    atomic_init(&h->cmd, 0);
    atomic_init(&h->done, 0);
    atomic_init(&h->n_conn, 0);
    h->kick_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    const char *why = h->kick_fd < 0 ? "eventfd" : NULL;
    if (!why && !MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_EPOLL_FD)) why = "libmicrohttpd's epoll set";
    pthread_mutex_init(&h->prep_mu, NULL);
    pthread_cond_init(&h->prep_cv, NULL);
    atomic_init(&h->prep_cpu_ns, 0);
    bool prep_started = false;
    if (!why && !(prep_started = pthread_create(&h->prep_th, NULL, prep_main, h) == 0)) why = "the prep thread";
    if (!why && pthread_create(&h->loop, NULL, loop_main, h) != 0) why = "its thread";
    if (why) {
        const int e = errno;
        if (prep_started) prep_stop(h);
        MHD_stop_daemon(h->d);
        if (h->kick_fd >= 0) close(h->kick_fd);
        srv_deadline_stop(h->dl);
        free(h);
        return moetax_error(MOETAX_ERR_INTERNAL, "cannot start the HTTP loop (%s): %s", why, strerror(e));
    }
    srv_sched_set_pacer(p->sched, &h->pace_due, kick, h);
    *out = h;
    return MOETAX_OK;
}

int srv_http_port(const struct srv_http *h) { return h->port; }

/* Ask the loop for cmd and wait (at most timeout_ms; 0: not at all) until it has been carried out. */
static void loop_command(struct srv_http *h, int cmd, int timeout_ms) {
    atomic_fetch_or(&h->cmd, cmd);
    const uint64_t one = 1;
    while (write(h->kick_fd, &one, sizeof one) < 0 && errno == EINTR) {}
    for (int waited = 0; waited < timeout_ms && !(atomic_load(&h->done) & cmd); waited++) {
        struct timespec ts = {0, 1000000L};
        nanosleep(&ts, NULL);
    }
}

void srv_http_quiesce(struct srv_http *h) { loop_command(h, CMD_QUIESCE, 1000); }

void srv_http_drain(struct srv_http *h, int timeout_ms) {
    for (int waited = 0; waited < timeout_ms; waited += 10) {
        if (atomic_load(&h->n_conn) == 0) return;
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

void srv_http_stop(struct srv_http *h) {
    if (!h) return;
    loop_command(h, CMD_STOP, 0);
    pthread_join(h->loop, NULL); /* it has resumed every suspended connection */
    MHD_stop_daemon(h->d);       /* every connection's CLOSED has removed its deadline entry; every
                                  * request still being prepared is abandoned */
    prep_stop(h);
    srv_deadline_stop(h->dl);
    close(h->kick_fd);
    free(h->waits);
    free(h->refusals);
    free(h);
}
