/* cmd_tokenize.c - `moetax tokenize`: encode text with a GGUF file's tokenizer
 * and print the token ids or pieces. Reads only the metadata: no weights are
 * loaded, so a GGUF that holds just the tokenizer keys works too. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "moetax/gguf.h"
#include "moetax/tokenizer.h"

static void usage(FILE *f) {
    fprintf(f, "usage: moetax tokenize [-m FILE] (-p TEXT | -f TEXTFILE) [--ids | --pieces] [--no-bos]\n\n"
               "Encodes text with the tokenizer of a GGUF file (tokenizer.ggml.* metadata; no weights are\n"
               "loaded) and prints the tokens.\n\n"
               "  -m, --model FILE   the GGUF file\n"
               "  -p, --prompt TEXT  the text to encode\n"
               "  -f, --file FILE    read the text from a file, byte for byte ('-': standard input)\n"
               "  --ids              print the token ids on one line, comma-separated (the default)\n"
               "  --pieces           print the bytes of each token, one token per line, escaped as in C:\n"
               "                     \\\\, \\n, \\r, \\t, and \\xNN for the other bytes of control characters\n"
               "                     (C0, DEL, C1) and for bytes that are not valid UTF-8 in the piece; BOS\n"
               "                     (a control token) is an empty line.\n"
               "                     Unescaping and concatenating the lines gives the text back.\n"
               "  --no-bos           do not put BOS in front (default: the file's add_bos setting)\n"
               CLI_MAX_INPUT_HELP);
}

/* Length of the valid UTF-8 sequence at s[0..n) of at least 2 bytes, or 0
 * (also 0 for the C1 controls U+0080..U+009F, which are escaped). */
static int utf8_len(const unsigned char *s, size_t n) {
    int len;
    unsigned v;
    if (s[0] >= 0xc2 && s[0] <= 0xdf) { len = 2; v = s[0] & 0x1fu; }
    else if (s[0] >= 0xe0 && s[0] <= 0xef) { len = 3; v = s[0] & 0x0fu; }
    else if (s[0] >= 0xf0 && s[0] <= 0xf4) { len = 4; v = s[0] & 0x07u; }
    else return 0;
    if ((size_t)len > n) return 0;
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        v = (v << 6) | (s[i] & 0x3fu);
    }
    if (v < 0xa0 || (len == 3 && v < 0x800) || (len == 4 && (v < 0x10000 || v > 0x10ffff)) || (v >= 0xd800 && v <= 0xdfff)) return 0;
    return len;
}

static void print_piece(FILE *f, const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        unsigned char c = s[i];
        int l;
        if (c == '\\') fputs("\\\\", f);
        else if (c == '\n') fputs("\\n", f);
        else if (c == '\r') fputs("\\r", f);
        else if (c == '\t') fputs("\\t", f);
        else if (c < 0x20 || c == 0x7f) fprintf(f, "\\x%02x", c);
        else if (c < 0x80) fputc(c, f);
        else if ((l = utf8_len(s + i, n - i)) > 0) {
            fwrite(s + i, 1, (size_t)l, f);
            i += (size_t)l;
            continue;
        } else fprintf(f, "\\x%02x", c);
        i++;
    }
    fputc('\n', f);
}

int cmd_tokenize(int argc, char **argv) {
    const char *model = NULL, *prompt = NULL, *pfile = NULL;
    bool pieces = false, ids_opt = false, no_bos = false;
    uint64_t max_input = 0;
    for (int i = 1; i < argc; i++) {
        bool err = false;
        if (cli_flag(argv, i, "-h", "--help")) { usage(stdout); return 0; }
        else if (cli_opt(argc, argv, &i, "-m", "--model", &model, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-p", "--prompt", &prompt, &err)) { if (err) return 2; }
        else if (cli_opt(argc, argv, &i, "-f", "--file", &pfile, &err)) { if (err) return 2; }
        else if (!strcmp(argv[i], "--ids")) ids_opt = true;
        else if (!strcmp(argv[i], "--pieces")) pieces = true;
        else if (!strcmp(argv[i], "--no-bos")) no_bos = true;
        else if (cli_max_input_opt("tokenize", argc, argv, &i, &max_input, &err)) { if (err) return 2; }
        else return cli_usage_error("tokenize", "unknown option '%s'", argv[i]);
    }
    if (!model) model = cli_default_model_path();
    if (!prompt && !pfile) return cli_usage_error("tokenize", "no text given (-p TEXT or -f FILE)");
    if (prompt && pfile) return cli_usage_error("tokenize", "-p and -f both given; use one");
    if (ids_opt && pieces) return cli_usage_error("tokenize", "--ids and --pieces both given; use one");

    char *text = NULL;
    size_t len = 0;
    moetax_status st = MOETAX_OK;
    if (pfile) {
        if ((st = cli_read_file(pfile, max_input, &text, &len))) return cli_fail("tokenize", st);
    } else {
        len = strlen(prompt);
        text = malloc(len + 1);
        if (!text) return cli_fail("tokenize", moetax_error(MOETAX_ERR_NOMEM, "out of memory"));
        memcpy(text, prompt, len + 1);
    }

    struct moetax_gguf *g = NULL;
    struct moetax_tokenizer *tok = NULL;
    int32_t *ids = NULL;
    char *piece = NULL;
    if ((st = moetax_gguf_open(model, &g))) goto done;
    st = moetax_tokenizer_load(g, &tok);
    moetax_gguf_close(g); /* the tokenizer keeps its own copy */
    if (st) goto done;

    int64_t n = 0;
    bool bos = !no_bos && moetax_tokenizer_add_bos(tok);
    if ((st = cli_encode(tok, text, len, bos, 0, &ids, &n))) goto done;

    if (!pieces) {
        for (int64_t i = 0; i < n; i++) printf(i ? ",%d" : "%d", (int)ids[i]);
        putchar('\n');
    } else {
        int pcap = 256;
        if (!(piece = malloc((size_t)pcap))) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto done; }
        for (int64_t i = 0; i < n; i++) {
            int nb = moetax_tokenizer_token_to_bytes(tok, ids[i], piece, pcap);
            if (nb < 0) {
                char *np = realloc(piece, (size_t)-nb);
                if (!np) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); goto done; }
                piece = np;
                pcap = -nb;
                nb = moetax_tokenizer_token_to_bytes(tok, ids[i], piece, pcap);
            }
            print_piece(stdout, (const unsigned char *)piece, (size_t)nb);
        }
    }
    if (fflush(stdout) != 0 || ferror(stdout))
        st = moetax_error(MOETAX_ERR_IO, "cannot write the output: %s", strerror(errno));

done:
    free(piece);
    free(ids);
    free(text);
    moetax_tokenizer_free(tok);
    return st ? cli_fail("tokenize", st) : 0;
}
