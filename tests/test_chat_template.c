// ctest-labels: unit
/* test_chat_template.c - chat template detection and rendering against the
 * known renderings: the conversation and expected outputs llama.cpp's
 * tests/test-chat-template.cpp lists for these templates (its non-Jinja path),
 * plus DeepSeek-V3 by its rendering rule. Some templates are cut to the parts
 * detection looks at (the renderings do not depend on the rest). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/chat_template.h"
#include "testutil.h"

#define U_EOS "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"
#define U_USER "<\xef\xbd\x9c" "User\xef\xbd\x9c>"
#define U_ASSISTANT "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>"

static const struct srv_chat_msg conv[] = {
    {"system", "You are a helpful assistant"}, {"user", "Hello"},        {"assistant", "Hi there"},
    {"user", "Who are you"},                   {"assistant", "   I am an assistant   "}, {"user", "Another question"},
};

struct tcase {
    const char *name, *tmpl;
    enum srv_chat_tmpl want;
    const char *expected;
};

static const struct tcase cases[] = {
    {"OpenHermes-2.5 (ChatML)",
     "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
     "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
     SRV_CHAT_CHATML,
     "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>"
     "assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n<|im_start|>assistant\n   I am an "
     "assistant   <|im_end|>\n<|im_start|>user\nAnother question<|im_end|>\n<|im_start|>assistant\n"},
    {"Mistral-7B-Instruct-v0.2 (llama2, no system)",
     "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + "
     "' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}",
     SRV_CHAT_LLAMA2,
     "[INST] You are a helpful assistant\nHello [/INST]Hi there</s>[INST] Who are you [/INST]   I am an assistant   "
     "</s>[INST] Another question [/INST]"},
    {"FusionNet (llama2-sys-bos)",
     "{%- for idx in range(0, messages|length) -%}{{- bos_token + '[INST] ' + messages[idx]['content'] + ' [/INST]' -}}"
     "{{- '[INST] <<SYS>>\\n' + messages[idx]['content'] + '\\n<</SYS>>\\n\\n' -}}",
     SRV_CHAT_LLAMA2_SYS_BOS,
     "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s><s>[INST] Who are you [/INST]"
     "   I am an assistant   </s><s>[INST] Another question [/INST]"},
    {"Llama-3",
     "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
     "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
     "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{{ '<|start_header_id|>assistant"
     "<|end_header_id|>\n\n' }}",
     SRV_CHAT_LLAMA3,
     "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|><|start_header_id|>user"
     "<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
     "<|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
     "\n\nI am an assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnother question<|eot_id|>"
     "<|start_header_id|>assistant<|end_header_id|>\n\n"},
    {"Phi-3-small",
     "{{ bos_token }}{% for message in messages %}{{'<|' + message['role'] + '|>' + '\n' + message['content'] + "
     "'<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}",
     SRV_CHAT_PHI3,
     "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n<|user|>"
     "\nWho are you<|end|>\n<|assistant|>\n   I am an assistant   <|end|>\n<|user|>\nAnother question<|end|>\n"
     "<|assistant|>\n"},
    {"DeepSeek-V2",
     "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{{ bos_token }}"
     "{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
     "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}{% elif "
     "message['role'] == 'system' %}{{ message['content'] + '\n\n' }}{% endif %}{% endfor %}{% if "
     "add_generation_prompt %}{{ 'Assistant:' }}{% endif %}",
     SRV_CHAT_DEEPSEEK2,
     "You are a helpful assistant\n\nUser: Hello\n\nAssistant: Hi there" U_EOS "User: Who are you\n\nAssistant:    I am "
     "an assistant   " U_EOS "User: Another question\n\nAssistant:"},
    {"DeepSeek-V3 (by its rule)",
     "{{bos_token}}{% for message in messages %}{% if message['role'] == 'user' %}{{'" U_USER "' + message['content']}}"
     "{% endif %}{% if message['role'] == 'assistant' %}{{'" U_ASSISTANT "' + message['content'] + '" U_EOS "'}}{% endif %}"
     "{% endfor %}",
     SRV_CHAT_DEEPSEEK3,
     "You are a helpful assistant\n\n" U_USER "Hello" U_ASSISTANT "Hi there" U_EOS U_USER "Who are you" U_ASSISTANT
     "   I am an assistant   " U_EOS U_USER "Another question" U_ASSISTANT},
    {"Mistral-7B-Instruct-v0.2 (mistral-v1, with a system prompt)",
     "{%- if messages[0]['role'] == 'system' %}{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + "
     "' [/INST]' }}{%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}",
     SRV_CHAT_MISTRAL_V1,
     " [INST] You are a helpful assistant\n\nHello [/INST] Hi there</s> [INST] Who are you [/INST]    I am an assistant"
     "   </s> [INST] Another question [/INST]"},
    {"Mistral-Large-Instruct-2407 (mistral-v3)",
     "{{- \"[AVAILABLE_TOOLS] [\" }}{{- \"[INST] \" + system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\" }}",
     SRV_CHAT_MISTRAL_V3,
     "[INST] You are a helpful assistant\n\nHello[/INST] Hi there</s>[INST] Who are you[/INST] I am an assistant</s>"
     "[INST] Another question[/INST]"},
    {"Mistral-Nemo-Instruct-2407 (mistral-v3-tekken)",
     "{{- \"[AVAILABLE_TOOLS][\" }}{{- \"[INST]\" + system_message + \"\\n\\n\" + message[\"content\"] + \"[/INST]\" }}",
     SRV_CHAT_MISTRAL_V3_TEKKEN,
     "[INST]You are a helpful assistant\n\nHello[/INST]Hi there</s>[INST]Who are you[/INST]   I am an assistant   </s>"
     "[INST]Another question[/INST]"},
    {"Mistral-Large-Instruct-2411 (mistral-v7)",
     "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + "
     "'[/INST]' }}{% elif message['role'] == 'system' %}{{ '[SYSTEM_PROMPT] ' + message['content'] + '[/SYSTEM_PROMPT]' }}",
     SRV_CHAT_MISTRAL_V7,
     "[SYSTEM_PROMPT] You are a helpful assistant[/SYSTEM_PROMPT][INST] Hello[/INST] Hi there</s>[INST] Who are you"
     "[/INST]    I am an assistant   </s>[INST] Another question[/INST]"},
};

int main(int argc, char **argv) {
    tu_init(argc, argv);
    const int n = (int)(sizeof conv / sizeof conv[0]);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const struct tcase *c = &cases[i];
        const enum srv_chat_tmpl t = srv_chat_detect(c->tmpl);
        CHECK_MSG(t == c->want, "%s: detected %s, want %s", c->name, srv_chat_name(t), srv_chat_name(c->want));
        size_t len = 0;
        char *out = srv_chat_render(c->want, conv, n, true, &len);
        CHECK_MSG(out && strcmp(out, c->expected) == 0, "%s: rendered\n%s\nwant\n%s", c->name, out ? out : "(null)",
                  c->expected);
        CHECK(out && len == strlen(out));
        free(out);
        /* the name is accepted too */
        CHECK(srv_chat_detect(srv_chat_name(c->want)) == c->want);
    }
    /* no template, or one nobody knows */
    CHECK(srv_chat_detect(NULL) == SRV_CHAT_UNKNOWN);
    CHECK(srv_chat_detect("") == SRV_CHAT_UNKNOWN);
    CHECK(srv_chat_detect("{{ messages }}") == SRV_CHAT_UNKNOWN);
    CHECK(srv_chat_render(SRV_CHAT_UNKNOWN, conv, n, true, NULL) == NULL);
    /* without the assistant's turn */
    char *o = srv_chat_render(SRV_CHAT_CHATML, conv + 1, 1, false, NULL);
    CHECK(o && strcmp(o, "<|im_start|>user\nHello<|im_end|>\n") == 0);
    free(o);
    /* roles: the four known ones (by length: "user\0x" is not "user"); tool only where a turn is written
     * with its role's name, every template's rendering of a tool message otherwise being another turn's */
    CHECK(srv_chat_role_known("tool", 4) && srv_chat_role_known("system", 6));
    CHECK(!srv_chat_role_known("developer", 9) && !srv_chat_role_known("user\0x", 6) && !srv_chat_role_known("", 0));
    for (int t = 1; t < SRV_CHAT_COUNT; t++) {
        const enum srv_chat_tmpl tt = (enum srv_chat_tmpl)t;
        CHECK(srv_chat_role_ok(tt, "system") && srv_chat_role_ok(tt, "user") && srv_chat_role_ok(tt, "assistant"));
        CHECK(!srv_chat_role_ok(tt, "robot"));
        const struct srv_chat_msg tool[] = {{"user", "q"}, {"tool", "TOOL-OUT"}};
        char *r = srv_chat_render(tt, tool, 2, true, NULL);
        const bool named = r && strstr(r, "TOOL-OUT") && strstr(r, "tool"); /* the role's name, lower case */
        CHECK_MSG(srv_chat_role_ok(tt, "tool") == named, "%s: role tool %s, rendered %s", srv_chat_name(tt),
                  srv_chat_role_ok(tt, "tool") ? "taken" : "refused", r ? r : "(null)");
        free(r);
    }
    return tu_finish("test_chat_template");
}
