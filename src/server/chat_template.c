/* chat_template.c - detection and rendering of the known chat templates (see chat_template.h). */
#include "server/chat_template.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const names[SRV_CHAT_COUNT] = {
    [SRV_CHAT_UNKNOWN] = "unknown",
    [SRV_CHAT_CHATML] = "chatml",
    [SRV_CHAT_LLAMA2] = "llama2",
    [SRV_CHAT_LLAMA2_SYS] = "llama2-sys",
    [SRV_CHAT_LLAMA2_SYS_BOS] = "llama2-sys-bos",
    [SRV_CHAT_LLAMA2_SYS_STRIP] = "llama2-sys-strip",
    [SRV_CHAT_MISTRAL_V1] = "mistral-v1",
    [SRV_CHAT_MISTRAL_V3] = "mistral-v3",
    [SRV_CHAT_MISTRAL_V3_TEKKEN] = "mistral-v3-tekken",
    [SRV_CHAT_MISTRAL_V7] = "mistral-v7",
    [SRV_CHAT_PHI3] = "phi3",
    [SRV_CHAT_LLAMA3] = "llama3",
    [SRV_CHAT_DEEPSEEK2] = "deepseek2",
    [SRV_CHAT_DEEPSEEK3] = "deepseek3",
};

const char *srv_chat_name(enum srv_chat_tmpl t) {
    return t > SRV_CHAT_UNKNOWN && t < SRV_CHAT_COUNT ? names[t] : "unknown";
}

enum srv_chat_tmpl srv_chat_by_name(const char *name) {
    for (int t = 1; name && t < SRV_CHAT_COUNT; t++)
        if (strcmp(name, names[t]) == 0) return (enum srv_chat_tmpl)t;
    return SRV_CHAT_UNKNOWN;
}

const char *srv_chat_names(char *buf, size_t cap) {
    size_t n = 0;
    if (cap) buf[0] = 0;
    for (int t = 1; t < SRV_CHAT_COUNT && n < cap; t++) {
        int w = snprintf(buf + n, cap - n, "%s%s", t > 1 ? ", " : "", names[t]);
        if (w < 0) break;
        n += (size_t)w;
    }
    return buf;
}

static const char *const roles[] = {"system", "user", "assistant", "tool"};

bool srv_chat_role_known(const char *role, size_t len) {
    for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++)
        if (strlen(roles[i]) == len && memcmp(role, roles[i], len) == 0) return true;
    return false;
}

bool srv_chat_role_ok(enum srv_chat_tmpl t, const char *role) {
    if (!srv_chat_role_known(role, strlen(role))) return false;
    if (strcmp(role, "tool") != 0) return true;
    return t == SRV_CHAT_CHATML || t == SRV_CHAT_PHI3 || t == SRV_CHAT_LLAMA3; /* the role's name is written */
}

enum srv_chat_tmpl srv_chat_detect(const char *tmpl) {
    if (!tmpl) return SRV_CHAT_UNKNOWN;
    for (int t = 1; t < SRV_CHAT_COUNT; t++)
        if (strcmp(tmpl, names[t]) == 0) return (enum srv_chat_tmpl)t;
#define HAS(x) (strstr(tmpl, (x)) != NULL)
    if (HAS("<|im_start|>")) return SRV_CHAT_CHATML;
    if (strncmp(tmpl, "mistral", 7) == 0 || HAS("[INST]")) {
        if (HAS("[SYSTEM_PROMPT]")) return SRV_CHAT_MISTRAL_V7;
        if (HAS("' [INST] ' + system_message") || HAS("[AVAILABLE_TOOLS]")) {
            if (HAS(" [INST]")) return SRV_CHAT_MISTRAL_V1;
            if (HAS("\"[INST]\"")) return SRV_CHAT_MISTRAL_V3_TEKKEN;
            return SRV_CHAT_MISTRAL_V3;
        }
        if (HAS("content.strip()")) return SRV_CHAT_LLAMA2_SYS_STRIP;
        if (HAS("bos_token + '[INST]")) return SRV_CHAT_LLAMA2_SYS_BOS;
        if (HAS("<<SYS>>")) return SRV_CHAT_LLAMA2_SYS;
        return SRV_CHAT_LLAMA2;
    }
    if (HAS("<|assistant|>") && HAS("<|end|>")) return SRV_CHAT_PHI3;
    if (HAS("<|start_header_id|>") && HAS("<|end_header_id|>")) return SRV_CHAT_LLAMA3;
    if (HAS("'Assistant: ' + message['content'] + eos_token")) return SRV_CHAT_DEEPSEEK2;
    if (HAS("<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>") && HAS("<\xef\xbd\x9c" "User\xef\xbd\x9c>") &&
        HAS("<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"))
        return SRV_CHAT_DEEPSEEK3;
#undef HAS
    return SRV_CHAT_UNKNOWN;
}

/* DeepSeek's full-width markers (U+FF5C, U+2581) */
#define DS_EOS "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"
#define DS_USER "<\xef\xbd\x9c" "User\xef\xbd\x9c>"
#define DS_ASSISTANT "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>"

struct sbuf {
    char *p;
    size_t len, cap;
    bool oom;
};

static void put_n(struct sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t c = (b->len + n + 1) * 2;
        char *q = realloc(b->p, c);
        if (!q) { b->oom = true; return; }
        b->p = q;
        b->cap = c;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}
static void put(struct sbuf *b, const char *s) { put_n(b, s, strlen(s)); }
/* s without leading and trailing white space (Python's str.strip / Jinja's trim for ASCII) */
static void put_trim(struct sbuf *b, const char *s) {
    size_t n = strlen(s);
    while (n && isspace((unsigned char)*s)) { s++; n--; }
    while (n && isspace((unsigned char)s[n - 1])) n--;
    put_n(b, s, n);
}
static bool is(const char *role, const char *r) { return strcmp(role, r) == 0; }

static void render_mistral(struct sbuf *b, enum srv_chat_tmpl t, const struct srv_chat_msg *m, int n) {
    if (t == SRV_CHAT_MISTRAL_V7) {
        for (int i = 0; i < n; i++) {
            if (is(m[i].role, "system")) { put(b, "[SYSTEM_PROMPT] "); put(b, m[i].content); put(b, "[/SYSTEM_PROMPT]"); }
            else if (is(m[i].role, "user")) { put(b, "[INST] "); put(b, m[i].content); put(b, "[/INST]"); }
            else { put(b, " "); put(b, m[i].content); put(b, "</s>"); }
        }
        return;
    }
    const char *lead = t == SRV_CHAT_MISTRAL_V1 ? " " : "";
    const char *trail = t == SRV_CHAT_MISTRAL_V3_TEKKEN ? "" : " ";
    bool in_turn = false;
    for (int i = 0; i < n; i++) {
        if (!in_turn) { put(b, lead); put(b, "[INST]"); put(b, trail); in_turn = true; }
        if (is(m[i].role, "system")) { put(b, m[i].content); put(b, "\n\n"); }
        else if (is(m[i].role, "user")) { put(b, m[i].content); put(b, lead); put(b, "[/INST]"); }
        else {
            put(b, trail);
            if (t == SRV_CHAT_MISTRAL_V3) put_trim(b, m[i].content);
            else put(b, m[i].content);
            put(b, "</s>");
            in_turn = false;
        }
    }
}

static void render_llama2(struct sbuf *b, enum srv_chat_tmpl t, const struct srv_chat_msg *m, int n) {
    const bool sys = t != SRV_CHAT_LLAMA2, bos_inside = t == SRV_CHAT_LLAMA2_SYS_BOS, strip = t == SRV_CHAT_LLAMA2_SYS_STRIP;
    bool in_turn = true; /* the first [INST] comes without a BOS */
    put(b, "[INST] ");
    for (int i = 0; i < n; i++) {
        if (!in_turn) { put(b, bos_inside ? "<s>[INST] " : "[INST] "); in_turn = true; }
        struct sbuf c = {0};
        if (strip) put_trim(&c, m[i].content);
        else put(&c, m[i].content);
        const char *content = c.p ? c.p : "";
        if (is(m[i].role, "system")) {
            if (sys) { put(b, "<<SYS>>\n"); put(b, content); put(b, "\n<</SYS>>\n\n"); }
            else { put(b, content); put(b, "\n"); }
        } else if (is(m[i].role, "user")) {
            put(b, content);
            put(b, " [/INST]");
        } else {
            put(b, content);
            put(b, "</s>");
            in_turn = false;
        }
        b->oom |= c.oom;
        free(c.p);
    }
}

char *srv_chat_render(enum srv_chat_tmpl t, const struct srv_chat_msg *m, int n, bool add_ass, size_t *len) {
    struct sbuf b = {0};
    put(&b, ""); /* an empty conversation is "" */
    switch (t) {
    case SRV_CHAT_CHATML:
        for (int i = 0; i < n; i++) {
            put(&b, "<|im_start|>"); put(&b, m[i].role); put(&b, "\n"); put(&b, m[i].content); put(&b, "<|im_end|>\n");
        }
        if (add_ass) put(&b, "<|im_start|>assistant\n");
        break;
    case SRV_CHAT_MISTRAL_V1: case SRV_CHAT_MISTRAL_V3: case SRV_CHAT_MISTRAL_V3_TEKKEN: case SRV_CHAT_MISTRAL_V7:
        render_mistral(&b, t, m, n);
        break;
    case SRV_CHAT_LLAMA2: case SRV_CHAT_LLAMA2_SYS: case SRV_CHAT_LLAMA2_SYS_BOS: case SRV_CHAT_LLAMA2_SYS_STRIP:
        render_llama2(&b, t, m, n);
        break;
    case SRV_CHAT_PHI3:
        for (int i = 0; i < n; i++) { put(&b, "<|"); put(&b, m[i].role); put(&b, "|>\n"); put(&b, m[i].content); put(&b, "<|end|>\n"); }
        if (add_ass) put(&b, "<|assistant|>\n");
        break;
    case SRV_CHAT_LLAMA3:
        for (int i = 0; i < n; i++) {
            put(&b, "<|start_header_id|>"); put(&b, m[i].role); put(&b, "<|end_header_id|>\n\n");
            put_trim(&b, m[i].content); put(&b, "<|eot_id|>");
        }
        if (add_ass) put(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case SRV_CHAT_DEEPSEEK2:
        for (int i = 0; i < n; i++) {
            if (is(m[i].role, "system")) { put(&b, m[i].content); put(&b, "\n\n"); }
            else if (is(m[i].role, "user")) { put(&b, "User: "); put(&b, m[i].content); put(&b, "\n\n"); }
            else if (is(m[i].role, "assistant")) { put(&b, "Assistant: "); put(&b, m[i].content); put(&b, DS_EOS); }
        }
        if (add_ass) put(&b, "Assistant:");
        break;
    case SRV_CHAT_DEEPSEEK3:
        for (int i = 0; i < n; i++) {
            if (is(m[i].role, "system")) { put(&b, m[i].content); put(&b, "\n\n"); }
            else if (is(m[i].role, "user")) { put(&b, DS_USER); put(&b, m[i].content); }
            else if (is(m[i].role, "assistant")) { put(&b, DS_ASSISTANT); put(&b, m[i].content); put(&b, DS_EOS); }
        }
        if (add_ass) put(&b, DS_ASSISTANT);
        break;
    default:
        free(b.p);
        return NULL;
    }
    if (b.oom) { free(b.p); return NULL; }
    if (len) *len = b.len;
    return b.p;
}
