/*
 * server/api.h - the OpenAI request and response shapes (Jansson).
 *
 * DESIGN
 *   srv_api_parse reads the body of POST /v1/completions or
 *   /v1/chat/completions: prompt (a string, or an array of one string) or
 *   messages ([{role, content}], role system, user, assistant or tool, content
 *   a string or an array of {"type": "text", "text"} parts), max_tokens (chat also
 *   max_completion_tokens), temperature, top_p, top_k, min_p, seed, stop (a
 *   string or an array of at most SRV_MAX_STOP non-empty strings), stream,
 *   stream_options.include_usage, n (1 only). Unknown fields are ignored; a
 *   null counts as absent; a known field of the wrong type or out of range is
 *   a 400 whose message names the field. Sampling defaults are llama-server's
 *   (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05); temperature 0 is
 *   greedy. Without a seed each request gets a fresh one.
 *
 *   Before Jansson sees a body, one pass over its bytes counts its objects and
 *   arrays and its values (array elements and object members), outside
 *   strings: past SRV_MAX_JSON_CONTAINERS or
 *   SRV_MAX_JSON_VALUES it is a 400 unparsed. Jansson spends a few hundred
 *   bytes on each empty object, so a body of "{}," within --max-body would
 *   otherwise cost some eighty times its size in heap while it is parsed.
 *
 *   Responses are built with Jansson; generated text goes through
 *   srv_utf8_sanitize first (bytes that are not valid UTF-8 become U+FFFD),
 *   since JSON strings must be valid UTF-8.
 */
#ifndef MOETAX_SERVER_API_H
#define MOETAX_SERVER_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "server/chat_template.h"
#include "server/sched.h"

/* The limits of the pre-parse count: four objects or arrays and sixteen values per message at the
 * most messages a chat request may have, far more than a real request needs. */
/* The JSON limits leave room for SRV_MAX_MESSAGES messages with a few content parts each, and for what agents
 * send beside them and the server ignores (tools' JSON schemas): 8 containers and 64 values per message. */
enum { SRV_MAX_MESSAGES = 4096, SRV_MAX_JSON_CONTAINERS = 8 * SRV_MAX_MESSAGES, SRV_MAX_JSON_VALUES = 64 * SRV_MAX_MESSAGES };

struct srv_api_req {
    bool chat;
    char *prompt;                       /* completions: the prompt (owned) */
    size_t prompt_len;
    struct srv_chat_msg *msgs;          /* chat: [n_msgs], strings owned */
    int n_msgs;
    int64_t max_tokens;                 /* -1: absent */
    struct moetax_sampler_params sp;
    bool has_seed;
    char *stop[SRV_MAX_STOP];
    int n_stop;
    bool stream, include_usage;
    bool ignore_eos;                    /* llama-server's extension: generate past end-of-text */
};

/* 0, or 400 with a message in err. */
int srv_api_parse(const char *body, size_t len, bool chat, struct srv_api_req *out, char *err, size_t errcap);
void srv_api_req_free(struct srv_api_req *r);

/* {"error": {"message", "type", "code"}} as a JSON text (malloc'd). */
char *srv_api_error_json(const char *message, const char *type, int code);
/* Error type for a status: invalid_request_error, authentication_error, not_found_error, ... */
const char *srv_api_error_type(int status);

/* A copy of n bytes with every byte that does not start a valid UTF-8 character replaced by U+FFFD. */
char *srv_utf8_sanitize(const char *s, size_t n, size_t *out_len);

struct srv_api_resp {
    bool chat;
    const char *id;                     /* "cmpl-..." / "chatcmpl-..." */
    const char *model;
    int64_t created;
    const char *text;
    size_t text_len;
    const char *finish_reason;          /* NULL: null (a stream chunk before the end) */
    int64_t prompt_tokens, completion_tokens, cached_tokens;
};
/* The whole response (non-streaming). */
char *srv_api_response_json(const struct srv_api_resp *r);
/* One stream chunk: delta text (chat: role too when first), or, when usage_only, the final
 * usage chunk (choices []). */
char *srv_api_chunk_json(const struct srv_api_resp *r, bool first, bool usage_only);

#endif
