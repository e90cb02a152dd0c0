/*
 * server/chat_template.h - chat messages to a prompt, without a Jinja engine.
 *
 * DESIGN
 *   A GGUF file's tokenizer.chat_template is a Jinja template. Like llama.cpp
 *   (src/llama-chat.cpp, llm_chat_detect_template) moetax does not run it: it
 *   recognises the known templates by substrings (a name such as "chatml" is
 *   accepted too) and renders each with a fixed rule written from the same
 *   facts (tests/test_chat_template.c checks the renderings llama.cpp's tests
 *   list for the templates). Detection, in llama.cpp's order:
 *     "<|im_start|>"                                   ChatML (Qwen)
 *     "[INST]" (or a template starting with "mistral") Mistral / Llama-2 family:
 *        "[SYSTEM_PROMPT]"                             mistral-v7
 *        "' [INST] ' + system_message" or "[AVAILABLE_TOOLS]":
 *           " [INST]" v1, "\"[INST]\"" v3-tekken, else v3
 *        else llama2: "content.strip()" sys-strip, "bos_token + '[INST]" sys-bos,
 *           "<<SYS>>" sys, else plain
 *     "<|assistant|>" and "<|end|>"                    Phi-3
 *     "<|start_header_id|>" and "<|end_header_id|>"    Llama-3
 *     "'Assistant: ' + message['content'] + eos_token" DeepSeek-V2
 *     "<｜Assistant｜>", "<｜User｜>" and "<｜end▁of▁sentence｜>"  DeepSeek-V3
 *   Anything else is SRV_CHAT_UNKNOWN. The BOS token is not part of the
 *   rendering (the tokenizer adds it when the model asks for one).
 *
 *   Roles: system, user and assistant render in every template; tool only in
 *   those that write a turn's role by name (ChatML, Phi-3, Llama-3): the
 *   Llama-2 and Mistral rules take every other role for the assistant and the
 *   DeepSeek ones drop it, so a server refuses those instead (srv_chat_role_ok).
 */
#ifndef MOETAX_SERVER_CHAT_TEMPLATE_H
#define MOETAX_SERVER_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

enum srv_chat_tmpl {
    SRV_CHAT_UNKNOWN = 0,
    SRV_CHAT_CHATML,
    SRV_CHAT_LLAMA2,
    SRV_CHAT_LLAMA2_SYS,
    SRV_CHAT_LLAMA2_SYS_BOS,
    SRV_CHAT_LLAMA2_SYS_STRIP,
    SRV_CHAT_MISTRAL_V1,
    SRV_CHAT_MISTRAL_V3,
    SRV_CHAT_MISTRAL_V3_TEKKEN,
    SRV_CHAT_MISTRAL_V7,
    SRV_CHAT_PHI3,
    SRV_CHAT_LLAMA3,
    SRV_CHAT_DEEPSEEK2,
    SRV_CHAT_DEEPSEEK3,
    SRV_CHAT_COUNT
};

struct srv_chat_msg {
    const char *role;    /* "system", "user", "assistant", ... */
    const char *content; /* NUL-terminated */
};

/* role[len] is one of the roles a chat message may have: system, user, assistant, tool. */
bool srv_chat_role_known(const char *role, size_t len);
/* t renders a message of this (known) role as that role's turn. */
bool srv_chat_role_ok(enum srv_chat_tmpl t, const char *role);
/* The template a Jinja source (or a name: "chatml", "llama3", "deepseek3", ...) is. */
enum srv_chat_tmpl srv_chat_detect(const char *tmpl);
/* The template of exactly this name (srv_chat_name's), SRV_CHAT_UNKNOWN for any other string: for an
 * option that takes a name, where srv_chat_detect's guess from a source would pick one for a typo. */
enum srv_chat_tmpl srv_chat_by_name(const char *name);
/* Every name, ", "-separated, into buf (truncated to cap); returns buf. */
const char *srv_chat_names(char *buf, size_t cap);
/* Its name ("chatml", "llama2-sys", "mistral-v7", "deepseek2", ...); "unknown". */
const char *srv_chat_name(enum srv_chat_tmpl t);
/* The prompt for n messages, ending with the assistant's turn when add_ass:
 * malloc'd, NUL-terminated, length in *len. NULL when out of memory or t is
 * SRV_CHAT_UNKNOWN. */
char *srv_chat_render(enum srv_chat_tmpl t, const struct srv_chat_msg *msgs, int n, bool add_ass, size_t *len);

#endif
