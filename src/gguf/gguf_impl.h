/* gguf_impl.h - helpers shared by the GGUF reader and writer (internal). */
#ifndef MOETAX_GGUF_IMPL_H
#define MOETAX_GGUF_IMPL_H

#include <stdbool.h>
#include <stdint.h>

uint64_t moetax_gguf_hash(const char *s, uint64_t n);
/* Valid UTF-8 with no NUL byte, no overlongs, no surrogates. */
bool moetax_utf8_valid(const char *s, uint64_t n);

struct moetax_gguf;
/* The mappings the SIGBUS handler knows (gguf_sigbus.c): added by moetax_gguf_open,
 * removed by moetax_gguf_close before the mapping goes. */
void moetax_gguf_sigbus_register(const struct moetax_gguf *g);
void moetax_gguf_sigbus_unregister(const struct moetax_gguf *g);

#endif
