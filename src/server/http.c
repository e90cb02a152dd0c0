/* http.c - libmicrohttpd glue: routes, limits, auth, streaming (see http.h). */
#include "server/http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
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

struct srv_http {
    struct srv_http_params p;
    struct MHD_Daemon *d;
    int port;
    int64_t created;
    atomic_ullong next_id;
    struct srv_deadline *dl; /* the request deadline (NULL: --read-timeout 0) */
    atomic_int streams;      /* streams being written now, from their first token (stream_interval
                              * stretches with them; a request still queued does not count) */
    atomic_ullong cpu_ns;    /* the HTTP threads' CPU time, counted as requests complete (count_cpu) */
};

/* Add the calling thread's CPU time since it last came here to h->cpu_ns. libmicrohttpd runs each
 * connection in a thread of its own, which calls this as each of its requests completes (and
 * handle_metrics, so that a scrape counts itself); a thread's time after its last request (the
 * close) is not counted. */
static _Thread_local uint64_t tls_cpu_counted_ns;
static void count_cpu(struct srv_http *h) {
    struct timespec ts;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return;
    const uint64_t now = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    if (now > tls_cpu_counted_ns) atomic_fetch_add(&h->cpu_ns, now - tls_cpu_counted_ns);
    tls_cpu_counted_ns = now;
}

/* Per connection (con_cls): the body as it arrives. */
struct conn {
    char *body;
    size_t len, cap;
    int route;
    bool chunked;   /* Transfer-Encoding: chunked: trailers may follow the body */
    bool responded; /* a response is queued: ignore the rest of the body */
};

enum route { R_NONE = 0, R_PAGE, R_HEALTH, R_MODELS, R_METRICS, R_TAX, R_COMPLETIONS, R_CHAT };

/* The route of (url, method); none: *status is 404, or 405 with *allow the methods the url takes. */
static int route_of(const char *url, const char *method, int *status, const char **allow) {
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

enum peer {
    PEER_HERE,      /* nothing to say: still connected */
    PEER_SENT_FIN,  /* it will send no more: closed, or only half-closed (shutdown(SHUT_WR)) */
    PEER_GONE,      /* reset, or both directions shut: nothing we write can arrive */
};

/* What the client's socket says, without waiting. A FIN is the same on the wire whether the
 * peer closed its socket or only its sending half; the difference shows only once we write:
 * a closed peer answers with a reset (POLLHUP | POLLERR here), a half-closed one takes it. */
static enum peer peer_state(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return PEER_HERE;
    struct pollfd pf = {.fd = ci->connect_fd, .events = POLLIN | POLLRDHUP};
    if (poll(&pf, 1, 0) <= 0) return PEER_HERE;
    if (pf.revents & (POLLHUP | POLLERR | POLLNVAL)) return PEER_GONE;
    if (pf.revents & POLLRDHUP) return PEER_SENT_FIN;
    if (pf.revents & POLLIN) {
        char b;
        const ssize_t n = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0) return PEER_SENT_FIN;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return PEER_GONE;
    }
    return PEER_HERE;
}

/* Restart libmicrohttpd's idle clock for c (its connection timeout), which only sends and
 * receives reset: time the server spends generating is not the client being idle. From c's own
 * thread only. Setting the timeout to 0 and back is the way 0.9.75's API offers (setting it from
 * 0 takes "now" as the last activity). */
static void idle_clock_restart(const struct srv_http *h, struct MHD_Connection *c) {
    if (!h->p.idle_timeout_s) return;
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, h->p.idle_timeout_s);
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
 * to on_request, which keeps it outside the pool (--max-body). */
enum { SRV_MHD_POOL_BYTES = 128 << 10, SRV_MAX_HEADER_BYTES = 32 << 10, SRV_MAX_HEADERS = 256 };

/* What a request's headers add up to: libmicrohttpd keeps a list entry in the pool for every header,
 * every cookie of a Cookie header (and a copy of that header), every argument of the URL's query and
 * every trailer of a chunked body, so all of them count. */
struct head_stats {
    size_t n, bytes;            /* entries; their names' and values' bytes with ": " and CRLF */
    int n_length, n_encoding;   /* Content-Length and Transfer-Encoding headers */
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
    if (f.n_encoding && (!f.encoding || strcasecmp(f.encoding, "chunked") != 0)) {
        *status = 501;
        return "Transfer-Encoding other than chunked is not supported";
    }
    return NULL;
}

static bool auth_ok(const struct srv_http *h, struct MHD_Connection *c) {
    if (!h->p.api_key) return true;
    const char *a = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!a || strncasecmp(a, "Bearer ", 7) != 0) return false;
    a += 7;
    const size_t n = strlen(a), k = strlen(h->p.api_key);
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
    bool probed;         /* the client sent a FIN: a comment went out to see whether it is still there */
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

/* Fill s->out with what the request has for the client; false when there is nothing (yet).
 * The request's lock is held only to copy what is new (the scheduler takes it for every
 * token): the JSON is made after. The last text and the end (finish chunk, usage, [DONE])
 * go in one event. */
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

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    struct stream *s = cls;
    (void)pos;
    const double t_enter = srv_now_s();
    for (;;) {
        if (s->out_off < s->out_len) {
            size_t n = s->out_len - s->out_off;
            if (n > max) n = max;
            memcpy(buf, s->out + s->out_off, n);
            s->out_off += n;
            if (s->out_off == s->out_len) s->out_off = s->out_len = 0;
            /* a wait here (a queue, a long prefill) must not count as the client's idle time:
             * libmicrohttpd checks its timeout before it sends these bytes. The timeout is whole
             * seconds (at least 1), so a shorter wait cannot reach it. */
            if (srv_now_s() - t_enter >= 0.5) idle_clock_restart(s->h, s->c);
            return (ssize_t)n;
        }
        if (s->done) return MHD_CONTENT_READER_END_OF_STREAM;
        /* pacing: at most one event per interval (the first token and the end at once). The
         * tokens of fast steps travel together instead of waking this thread, the client and
         * the network stack once per step, which on a machine whose cores all decode takes a
         * core from the step each time. */
        const double iv = stream_interval(s->h);
        if (iv > 0 && s->t_sent > 0 && srv_now_s() < s->t_sent + iv) {
            pthread_mutex_lock(&s->r->mu);
            srv_req_wait_until_locked(s->r, s->t_sent + iv);
            pthread_mutex_unlock(&s->r->mu);
        }
        if (stream_fill(s)) continue;
        const enum peer ps = peer_state(s->c);
        if (ps == PEER_GONE) {
            srv_req_cancel(s->r);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (ps == PEER_SENT_FIN && !s->probed) {
            /* closed, or half-closed (nc -N) and still reading? An SSE comment, which clients
             * ignore, tells: a closed peer resets the connection (PEER_GONE at the next look),
             * a half-closed one takes it and gets the rest of its stream. */
            static const char probe[] = ":\n\n";
            if (max >= sizeof probe - 1) {
                s->probed = true;
                memcpy(buf, probe, sizeof probe - 1);
                if (srv_now_s() - t_enter >= 0.5) idle_clock_restart(s->h, s->c);
                return (ssize_t)(sizeof probe - 1);
            }
        }
        pthread_mutex_lock(&s->r->mu);
        srv_req_wait_locked(s->r, s->sent, 50);
        pthread_mutex_unlock(&s->r->mu);
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

static enum MHD_Result handle_generate(struct srv_http *h, struct MHD_Connection *c, struct conn *cs, bool chat) {
    char err[512];
    struct srv_api_req q;
    if (chat && h->p.tmpl == SRV_CHAT_UNKNOWN)
        return send_error(c, 400, "this model has no chat template moetax knows (tokenizer.chat_template is missing or "
                                  "not recognised): use /v1/completions with a plain prompt instead");
    if (srv_api_parse(cs->body ? cs->body : "", cs->len, chat, &q, err, sizeof err)) return send_error(c, 400, err);
    for (int i = 0; i < q.n_msgs; i++) {
        if (srv_chat_role_ok(h->p.tmpl, q.msgs[i].role)) continue;
        snprintf(err, sizeof err, "'messages[%d].role' is \"%s\", for which the %s chat template has no turn (it takes "
                 "system, user and assistant)", i, q.msgs[i].role, srv_chat_name(h->p.tmpl));
        srv_api_req_free(&q);
        return send_error(c, 400, err);
    }
    char *text = q.prompt;
    size_t text_len = q.prompt_len;
    char *rendered = NULL;
    if (chat) {
        if (!(rendered = srv_chat_render(h->p.tmpl, q.msgs, q.n_msgs, true, &text_len))) {
            srv_api_req_free(&q);
            return send_error(c, 500, "out of memory");
        }
        text = rendered;
    }
    /* tokenize here, in the connection's thread; a chat prompt's control tokens as single ids */
    int32_t *ids = NULL;
    int64_t n_ids = 0;
    moetax_status st = srv_encode_special(h->p.tok, chat ? h->p.specials : NULL, text, text_len,
                                          moetax_tokenizer_add_bos(h->p.tok), &ids, &n_ids);
    free(rendered);
    if (st) { srv_api_req_free(&q); return send_error(c, 500, "cannot tokenize the prompt"); }
    if (n_ids == 0) { free(ids); srv_api_req_free(&q); return send_error(c, 400, "the prompt is empty"); }
    struct srv_req *r = srv_req_new(ids, n_ids);
    free(ids);
    if (!r) { srv_api_req_free(&q); return send_error(c, 500, "out of memory"); }
    const int64_t room = srv_sched_max_seq(h->p.sched) - n_ids;
    r->max_tokens = q.max_tokens > 0 ? q.max_tokens : (room < h->p.default_max_tokens ? room : h->p.default_max_tokens);
    r->sp = q.sp;
    r->ignore_eos = q.ignore_eos;
    if (!q.has_seed) r->sp.seed = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull + atomic_fetch_add(&h->next_id, 1);
    for (int i = 0; i < q.n_stop; i++) { r->stop[i] = q.stop[i]; q.stop[i] = NULL; }
    r->n_stop = q.n_stop;
    q.n_stop = 0;
    const bool stream = q.stream, include_usage = q.include_usage;
    srv_api_req_free(&q);
    if (r->max_tokens < 1) {
        snprintf(err, sizeof err, "the prompt (%lld tokens) leaves no room in the %lld positions a request may use",
                 (long long)n_ids, (long long)srv_sched_max_seq(h->p.sched));
        srv_req_unref(r);
        return send_error(c, 400, err);
    }
    st = srv_sched_submit(h->p.sched, r);
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
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, s, stream_free);
        if (!resp) { stream_free(s); return MHD_NO; }
        MHD_add_response_header(resp, "Content-Type", "text/event-stream");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        enum MHD_Result ok = MHD_queue_response(c, 200, resp);
        MHD_destroy_response(resp);
        return ok;
    }
    /* wait for the end, watching the client */
    pthread_mutex_lock(&r->mu);
    while (r->finish == SRV_FINISH_NONE) {
        srv_req_wait_locked(r, SIZE_MAX, 50);
        if (r->finish != SRV_FINISH_NONE) break;
        pthread_mutex_unlock(&r->mu);
        /* nothing can be written before the answer's status line, so a FIN cannot be told from
         * a close here: a client that half-closes is taken as gone (as Go's net/http and hyper do) */
        const bool gone = peer_state(c) != PEER_HERE;
        pthread_mutex_lock(&r->mu);
        if (gone) {
            pthread_mutex_unlock(&r->mu);
            srv_req_cancel(r);
            srv_req_unref(r);
            return MHD_NO; /* closes the connection */
        }
    }
    enum MHD_Result ok;
    if (r->finish == SRV_FINISH_STOP || r->finish == SRV_FINISH_LENGTH) {
        struct srv_api_resp a;
        resp_init(h, r, chat, id, &a);
        a.text = r->text;
        a.text_len = r->len;
        a.finish_reason = srv_finish_name(r->finish);
        char *j = srv_api_response_json(&a);
        pthread_mutex_unlock(&r->mu);
        ok = send_json(c, 200, j);
    } else {
        snprintf(err, sizeof err, "%s", r->err[0] ? r->err : "the request ended");
        const bool cancelled = r->finish == SRV_FINISH_CANCELLED;
        pthread_mutex_unlock(&r->mu);
        ok = send_error(c, cancelled ? 503 : 500, err);
    }
    srv_req_unref(r);
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
    count_cpu(h);
    m.http_cpu_s = (double)atomic_load(&h->cpu_ns) * 1e-9;
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

/* Milliseconds left until the monotonic time `until` (seconds), at least 0. */
static int ms_left(double until) {
    const double left = until - srv_now_s();
    return left > 0 ? (int)(left * 1000) + 1 : 0;
}

/* An error answered while the body is still arriving, and the connection closed. libmicrohttpd (0.9.75)
 * takes an answer only with the headers or once the request is whole, so this one is written to the
 * socket here, with "Connection: close"; then the sending half is shut and what the client still sends
 * is read and dropped until it closes, for at most LINGER_MS (a close with unread bytes sends a reset,
 * which can destroy the answer before the client has read it); then MHD_NO closes the connection. */
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
    const double until = srv_now_s() + LINGER_MS / 1000.0;
    for (size_t off = 0; n > 0 && off < (size_t)n;) { /* the socket may be non-blocking: wait for room */
        const ssize_t w = send(fd, out + off, (size_t)n - off, MSG_NOSIGNAL);
        if (w > 0) { off += (size_t)w; continue; }
        if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) break;
        struct pollfd pf = {.fd = fd, .events = POLLOUT};
        if (poll(&pf, 1, ms_left(until)) <= 0) break;
    }
    if (n > 0) free(out);
    (void)shutdown(fd, SHUT_WR);
    for (;;) {
        char drop[4096];
        const ssize_t r = recv(fd, drop, sizeof drop, MSG_DONTWAIT);
        if (r > 0) continue;
        if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) break;
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, ms_left(until)) <= 0) break;
    }
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
    count_cpu(h);
    struct conn *cs = *con_cls;
    if (!cs) return;
    free(cs->body);
    free(cs);
    *con_cls = NULL;
}

/* Connections open and close (libmicrohttpd's NOTIFY_CONNECTION; registered with a request
 * deadline only). STARTED runs in the daemon's thread before the connection's own thread
 * starts; 0.9.75 calls CLOSED after joining that thread and before it closes the socket
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

moetax_status srv_http_start(const struct srv_http_params *p, struct srv_http **out) {
    *out = NULL;
    struct srv_http *h = calloc(1, sizeof *h);
    if (!h) return moetax_error(MOETAX_ERR_NOMEM, "out of memory");
    h->p = *p;
    h->created = now_unix();
    atomic_init(&h->next_id, 1);
    struct sockaddr_storage ss = {0};
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | MHD_USE_ITC |
                     MHD_USE_ERROR_LOG;
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
                            MHD_OPTION_THREAD_STACK_SIZE, (size_t)(512 << 10), MHD_OPTION_NOTIFY_COMPLETED,
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
    *out = h;
    return MOETAX_OK;
}

int srv_http_port(const struct srv_http *h) { return h->port; }

void srv_http_quiesce(struct srv_http *h) {
    const MHD_socket fd = MHD_quiesce_daemon(h->d);
    if (fd != MHD_INVALID_SOCKET) close(fd);
}

void srv_http_drain(struct srv_http *h, int timeout_ms) {
    for (int waited = 0; waited < timeout_ms; waited += 10) {
        const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
        if (!di || di->num_connections == 0) return;
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

void srv_http_stop(struct srv_http *h) {
    if (!h) return;
    MHD_stop_daemon(h->d); /* every connection's CLOSED has removed its deadline entry */
    srv_deadline_stop(h->dl);
    free(h);
}
