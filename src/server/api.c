/* api.c - OpenAI request parsing and response building (see api.h). */
#include "server/api.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int fail(char *err, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    return 400;
}

/* A field, NULL when absent or null. */
static json_t *field(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    return v && !json_is_null(v) ? v : NULL;
}

static int get_num(json_t *o, const char *k, double lo, double hi, double *out, char *err, size_t cap) {
    json_t *v = field(o, k);
    if (!v) return 0;
    if (!json_is_number(v)) return fail(err, cap, "'%s' must be a number", k);
    const double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) return fail(err, cap, "'%s' must be between %g and %g", k, lo, hi);
    *out = x;
    return 0;
}

static int get_int(json_t *o, const char *k, int64_t lo, int64_t hi, int64_t *out, char *err, size_t cap) {
    json_t *v = field(o, k);
    if (!v) return 0;
    if (!json_is_integer(v)) return fail(err, cap, "'%s' must be an integer", k);
    const json_int_t x = json_integer_value(v);
    if (x < lo || x > hi) return fail(err, cap, "'%s' must be between %lld and %lld", k, (long long)lo, (long long)hi);
    *out = x;
    return 0;
}

/* OpenAI's fields this server does not implement: their types checked like every field's, and a value
 * that would change the answer refused (a 400 naming the field), so that no client gets an answer that
 * silently lacks what it asked for; the neutral values (0, false, null, 1, "", {}) pass. */
static int check_unsupported(json_t *o, bool chat, char *err, size_t cap) {
    static const char *const penalties[] = {"frequency_penalty", "presence_penalty"};
    for (int i = 0; i < 2; i++) {
        double x = 0;
        int rc = get_num(o, penalties[i], -2, 2, &x, err, cap);
        if (rc) return rc;
        if (x != 0) return fail(err, cap, "'%s' is not supported by this server (only 0)", penalties[i]);
    }
    json_t *v;
    if ((v = field(o, "logprobs"))) {
        if (chat ? !json_is_boolean(v) : !json_is_integer(v))
            return fail(err, cap, "'logprobs' must be %s", chat ? "a boolean" : "an integer");
        if (chat ? json_is_true(v) : json_integer_value(v) != 0)
            return fail(err, cap, "'logprobs' is not supported by this server");
    }
    if (chat && (v = field(o, "top_logprobs"))) {
        if (!json_is_integer(v)) return fail(err, cap, "'top_logprobs' must be an integer");
        if (json_integer_value(v) != 0) return fail(err, cap, "'top_logprobs' is not supported by this server");
    }
    if ((v = field(o, "logit_bias"))) {
        if (!json_is_object(v)) return fail(err, cap, "'logit_bias' must be an object");
        if (json_object_size(v)) return fail(err, cap, "'logit_bias' is not supported by this server");
    }
    if (!chat && (v = field(o, "echo"))) {
        if (!json_is_boolean(v)) return fail(err, cap, "'echo' must be a boolean");
        if (json_is_true(v)) return fail(err, cap, "'echo' is not supported by this server");
    }
    if (!chat && (v = field(o, "best_of"))) {
        if (!json_is_integer(v)) return fail(err, cap, "'best_of' must be an integer");
        if (json_integer_value(v) != 1) return fail(err, cap, "'best_of' must be 1 (one choice per request)");
    }
    if (!chat && (v = field(o, "suffix"))) {
        if (!json_is_string(v)) return fail(err, cap, "'suffix' must be a string");
        if (json_string_length(v)) return fail(err, cap, "'suffix' is not supported by this server");
    }
    if ((v = field(o, "user")) && !json_is_string(v)) return fail(err, cap, "'user' must be a string");
    return 0;
}

static char *dup_n(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) { memcpy(d, s, n); d[n] = 0; }
    return d;
}

/* Chat content: a string or an array of {"type": "text", "text": ...} parts (joined). */
static int content_text(json_t *c, int i, char **out, char *err, size_t cap) {
    if (!c) { *out = dup_n("", 0); return *out ? 0 : fail(err, cap, "out of memory"); }
    if (json_is_string(c)) {
        *out = dup_n(json_string_value(c), json_string_length(c));
        return *out ? 0 : fail(err, cap, "out of memory");
    }
    if (!json_is_array(c)) return fail(err, cap, "'messages[%d].content' must be a string or an array of parts", i);
    size_t total = 0, k;
    json_t *part;
    json_array_foreach(c, k, part) {
        json_t *ty = json_object_get(part, "type"), *tx = json_object_get(part, "text");
        if (!json_is_object(part) || !json_is_string(ty) || strcmp(json_string_value(ty), "text") != 0 || !json_is_string(tx))
            return fail(err, cap, "'messages[%d].content[%zu]' must be {\"type\": \"text\", \"text\": string} "
                        "(other parts are not supported)", i, k);
        total += json_string_length(tx);
    }
    char *s = malloc(total + 1);
    if (!s) return fail(err, cap, "out of memory");
    size_t at = 0;
    json_array_foreach(c, k, part) {
        json_t *tx = json_object_get(part, "text");
        memcpy(s + at, json_string_value(tx), json_string_length(tx));
        at += json_string_length(tx);
    }
    s[at] = 0;
    *out = s;
    return 0;
}

static int parse_stop(json_t *o, struct srv_api_req *r, char *err, size_t cap) {
    json_t *v = field(o, "stop");
    if (!v) return 0;
    json_t *one[1] = {v};
    json_t **list = one;
    size_t n = 1;
    if (json_is_array(v)) {
        n = json_array_size(v);
        if (n > SRV_MAX_STOP) return fail(err, cap, "'stop' may hold at most %d strings", SRV_MAX_STOP);
        list = NULL;
    } else if (!json_is_string(v)) {
        return fail(err, cap, "'stop' must be a string or an array of strings");
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = list ? list[i] : json_array_get(v, i);
        if (!json_is_string(s)) return fail(err, cap, "'stop' must be a string or an array of strings");
        const size_t len = json_string_length(s);
        if (len == 0) continue; /* an empty stop string stops nothing */
        if (len > SRV_MAX_STOP_LEN) return fail(err, cap, "a 'stop' string is longer than %d bytes", SRV_MAX_STOP_LEN);
        if (memchr(json_string_value(s), 0, len)) return fail(err, cap, "a 'stop' string holds a NUL");
        if (!(r->stop[r->n_stop++] = dup_n(json_string_value(s), len))) return fail(err, cap, "out of memory");
    }
    return 0;
}

/* The body's objects and arrays, and its values (array elements and object members: a non-empty
 * container's first one, then one per comma), outside strings, against the limits (api.h). Strings are
 * scanned as Jansson lexes them, so the counts are exact for all that Jansson would parse of the body
 * before it found an error. */
static int json_budget(const char *body, size_t len, char *err, size_t cap) {
    size_t containers = 0, values = 0;
    bool in_string = false, opened = false; /* opened: a container began, its first value not yet seen */
    for (size_t i = 0; i < len; i++) {
        const char ch = body[i];
        if (in_string) {
            if (ch == '\\') i++;
            else if (ch == '"') in_string = false;
            continue;
        }
        if (ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r') continue;
        if (opened && ch != '}' && ch != ']') values++;
        opened = false;
        if (ch == '"') {
            in_string = true;
        } else if (ch == '{' || ch == '[') {
            if (++containers > SRV_MAX_JSON_CONTAINERS)
                return fail(err, cap, "the body holds more than %d JSON objects and arrays (refused unparsed)",
                            SRV_MAX_JSON_CONTAINERS);
            opened = true;
        } else if (ch == ',') {
            values++;
        }
        if (values > SRV_MAX_JSON_VALUES)
            return fail(err, cap, "the body holds more than %d JSON values (array elements and object members; "
                        "refused unparsed)", SRV_MAX_JSON_VALUES);
    }
    return 0;
}

int srv_api_parse(const char *body, size_t len, bool chat, struct srv_api_req *r, char *err, size_t cap) {
    memset(r, 0, sizeof *r);
    r->chat = chat;
    r->max_tokens = -1;
    r->sp = moetax_sampler_default_params();
    r->sp.repeat_penalty = 1.0f;
    if (json_budget(body, len, err, cap)) return 400;
    json_error_t je;
    json_t *o = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!o) return fail(err, cap, "the body is not valid JSON (line %d, column %d: %s)", je.line, je.column, je.text);
    int rc = 0;
    if (!json_is_object(o)) { rc = fail(err, cap, "the body must be a JSON object"); goto done; }
    json_t *v;
    if ((v = field(o, "model")) && !json_is_string(v)) { rc = fail(err, cap, "'model' must be a string"); goto done; }
    if (chat) {
        v = field(o, "messages");
        if (!v || !json_is_array(v) || json_array_size(v) == 0) {
            rc = fail(err, cap, "'messages' must be a non-empty array of {\"role\", \"content\"}");
            goto done;
        }
        const size_t n = json_array_size(v);
        if (n > SRV_MAX_MESSAGES) { rc = fail(err, cap, "'messages' has more than %d entries", SRV_MAX_MESSAGES); goto done; }
        if (!(r->msgs = calloc(n, sizeof *r->msgs))) { rc = fail(err, cap, "out of memory"); goto done; }
        for (size_t i = 0; i < n; i++) {
            json_t *m = json_array_get(v, i), *role = json_object_get(m, "role");
            if (!json_is_object(m) || !json_is_string(role)) {
                rc = fail(err, cap, "'messages[%zu]' must be an object with a string 'role'", i);
                goto done;
            }
            const char *rname = json_string_value(role);
            size_t rlen = json_string_length(role);
            if (rlen == 9 && !memcmp(rname, "developer", 9)) rname = "system", rlen = 6; /* OpenAI's newer name */
            if (!srv_chat_role_known(rname, rlen)) {
                rc = fail(err, cap, "'messages[%zu].role' must be system, developer (taken as system), user, "
                          "assistant or tool (got \"%.40s\")", i, json_string_value(role));
                goto done;
            }
            char *content = NULL;
            if ((rc = content_text(field(m, "content"), (int)i, &content, err, cap))) goto done;
            r->msgs[i].content = content;
            r->n_msgs++;
            if (!(r->msgs[i].role = dup_n(rname, rlen))) {
                rc = fail(err, cap, "out of memory");
                goto done;
            }
        }
    } else {
        v = field(o, "prompt");
        if (v && json_is_array(v)) {
            if (json_array_size(v) != 1 || !json_is_string(json_array_get(v, 0))) {
                rc = fail(err, cap, "'prompt' must be a string or an array of one string (several prompts and "
                          "token arrays are not supported)");
                goto done;
            }
            v = json_array_get(v, 0);
        }
        if (!v || !json_is_string(v)) { rc = fail(err, cap, "'prompt' must be a string"); goto done; }
        r->prompt_len = json_string_length(v);
        if (!(r->prompt = dup_n(json_string_value(v), r->prompt_len))) { rc = fail(err, cap, "out of memory"); goto done; }
    }
    int64_t n = 1, x;
    if ((rc = get_int(o, "n", 1, 1 << 20, &n, err, cap))) goto done;
    if (n != 1) { rc = fail(err, cap, "'n' must be 1 (one choice per request)"); goto done; }
    if ((rc = get_int(o, "max_tokens", 1, INT32_MAX, &r->max_tokens, err, cap))) goto done;
    if (chat && (rc = get_int(o, "max_completion_tokens", 1, INT32_MAX, &r->max_tokens, err, cap))) goto done;
    double d;
    d = r->sp.temp;
    if ((rc = get_num(o, "temperature", 0, 100, &d, err, cap))) goto done;
    r->sp.temp = (float)d;
    d = r->sp.top_p;
    if ((rc = get_num(o, "top_p", 1e-9, 1, &d, err, cap))) goto done;
    r->sp.top_p = (float)d;
    d = r->sp.min_p;
    if ((rc = get_num(o, "min_p", 0, 1, &d, err, cap))) goto done;
    r->sp.min_p = (float)d;
    x = r->sp.top_k;
    if ((rc = get_int(o, "top_k", 0, INT32_MAX, &x, err, cap))) goto done;
    r->sp.top_k = (int32_t)x;
    if ((v = field(o, "seed"))) {
        if (!json_is_integer(v)) { rc = fail(err, cap, "'seed' must be an integer"); goto done; }
        r->sp.seed = (uint64_t)json_integer_value(v);
        r->has_seed = true;
    }
    if ((rc = parse_stop(o, r, err, cap))) goto done;
    if ((rc = check_unsupported(o, chat, err, cap))) goto done;
    if ((v = field(o, "stream"))) {
        if (!json_is_boolean(v)) { rc = fail(err, cap, "'stream' must be a boolean"); goto done; }
        r->stream = json_is_true(v);
    }
    if ((v = field(o, "ignore_eos"))) { /* llama-server's extension (benchmarks) */
        if (!json_is_boolean(v)) { rc = fail(err, cap, "'ignore_eos' must be a boolean"); goto done; }
        r->ignore_eos = json_is_true(v);
    }
    if ((v = field(o, "stream_options"))) {
        json_t *u = field(v, "include_usage");
        if (!json_is_object(v) || (u && !json_is_boolean(u))) {
            rc = fail(err, cap, "'stream_options' must be an object with a boolean 'include_usage'");
            goto done;
        }
        r->include_usage = u && json_is_true(u);
    }
done:
    json_decref(o);
    if (rc) srv_api_req_free(r);
    return rc;
}

void srv_api_req_free(struct srv_api_req *r) {
    free(r->prompt);
    for (int i = 0; i < r->n_msgs; i++) {
        free((char *)r->msgs[i].role);
        free((char *)r->msgs[i].content);
    }
    free(r->msgs);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    memset(r, 0, sizeof *r);
}

const char *srv_api_error_type(int status) {
    switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 405: return "invalid_request_error";
    case 413: return "invalid_request_error";
    case 503: return "unavailable_error";
    case 500: return "server_error";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
    }
}

static char *dump(json_t *o) {
    if (!o) return NULL;
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

char *srv_api_error_json(const char *message, const char *type, int code) {
    size_t n;
    char *m = srv_utf8_sanitize(message, strlen(message), &n);
    if (!m) return NULL;
    json_t *o = json_pack("{s:{s:s%,s:s,s:i}}", "error", "message", m, n, "type", type, "code", code);
    free(m);
    return dump(o);
}

/* Length of the valid UTF-8 character at s (n bytes left), 0 if invalid. */
static size_t utf8_char(const unsigned char *s, size_t n) {
    const unsigned char c = s[0];
    if (c < 0x80) return 1;
    size_t len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) { len = 2; cp = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; cp = c & 0x0F; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; cp = c & 0x07; }
    else return 0;
    if (n < len) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
        return 0;
    return len;
}

char *srv_utf8_sanitize(const char *s, size_t n, size_t *out_len) {
    char *o = malloc(n * 3 + 1);
    if (!o) return NULL;
    size_t j = 0;
    for (size_t i = 0; i < n;) {
        const size_t k = utf8_char((const unsigned char *)s + i, n - i);
        if (k) { memcpy(o + j, s + i, k); j += k; i += k; }
        else { memcpy(o + j, "\xef\xbf\xbd", 3); j += 3; i++; }
    }
    o[j] = 0;
    *out_len = j;
    return o;
}

static json_t *usage(const struct srv_api_resp *r) {
    return json_pack("{s:I,s:I,s:I,s:{s:I}}", "prompt_tokens", (json_int_t)r->prompt_tokens, "completion_tokens",
                     (json_int_t)r->completion_tokens, "total_tokens", (json_int_t)(r->prompt_tokens + r->completion_tokens),
                     "prompt_tokens_details", "cached_tokens", (json_int_t)r->cached_tokens);
}

static json_t *text_json(const struct srv_api_resp *r) {
    size_t n;
    char *t = srv_utf8_sanitize(r->text ? r->text : "", r->text ? r->text_len : 0, &n);
    if (!t) return NULL;
    json_t *j = json_stringn(t, n);
    free(t);
    return j;
}

static json_t *finish_json(const struct srv_api_resp *r) {
    return r->finish_reason ? json_string(r->finish_reason) : json_null();
}

char *srv_api_response_json(const struct srv_api_resp *r) {
    json_t *choice;
    if (r->chat)
        choice = json_pack("{s:i,s:{s:s,s:o*},s:n,s:o*}", "index", 0, "message", "role", "assistant", "content",
                           text_json(r), "logprobs", "finish_reason", finish_json(r));
    else
        choice = json_pack("{s:o*,s:i,s:n,s:o*}", "text", text_json(r), "index", 0, "logprobs", "finish_reason",
                           finish_json(r));
    return dump(json_pack("{s:s,s:s,s:I,s:s,s:[o*],s:o*}", "id", r->id, "object",
                          r->chat ? "chat.completion" : "text_completion", "created", (json_int_t)r->created, "model",
                          r->model, "choices", choice, "usage", usage(r)));
}

char *srv_api_chunk_json(const struct srv_api_resp *r, bool first, bool usage_only) {
    const char *object = r->chat ? "chat.completion.chunk" : "text_completion";
    if (usage_only)
        return dump(json_pack("{s:s,s:s,s:I,s:s,s:[],s:o*}", "id", r->id, "object", object, "created",
                              (json_int_t)r->created, "model", r->model, "choices", "usage", usage(r)));
    json_t *choice;
    if (r->chat) {
        json_t *delta = json_object();
        if (delta && first) json_object_set_new(delta, "role", json_string("assistant"));
        if (delta && (r->text_len || !r->finish_reason)) json_object_set_new(delta, "content", text_json(r));
        choice = json_pack("{s:i,s:o*,s:n,s:o*}", "index", 0, "delta", delta, "logprobs", "finish_reason", finish_json(r));
    } else {
        choice = json_pack("{s:o*,s:i,s:n,s:o*}", "text", text_json(r), "index", 0, "logprobs", "finish_reason",
                           finish_json(r));
    }
    return dump(json_pack("{s:s,s:s,s:I,s:s,s:[o*]}", "id", r->id, "object", object, "created", (json_int_t)r->created,
                          "model", r->model, "choices", choice));
}
