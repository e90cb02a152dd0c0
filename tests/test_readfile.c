// ctest-labels: unit
/* test_readfile.c - the bounded whole-file reader (moetax/readfile.h): a file over the limit, one of
 * exactly the limit, an empty file, a directory, a missing file, a file larger than the first chunk,
 * a read error, a pipe and a FIFO as streams, standard input, /dev/zero (the limit stops it; as text
 * the first NUL does), and text with a NUL byte (its line and offset named). */
#include "moetax/readfile.h"
#include "testutil.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* a file of name (prefixed "readfile_" in the scratch directory) holding n bytes of b */
static const char *put_bytes(const char *name, const char *b, size_t n) {
    char full[256];
    snprintf(full, sizeof full, "readfile_%s", name);
    const char *path = tu_path(full);
    FILE *f = fopen(path, "wb");
    if (f) {
        if (n) fwrite(b, 1, n, f);
        fclose(f);
    }
    return path;
}

static bool has(const char *what) { return strstr(moetax_last_error(), what) != NULL; }

/* a failed read leaves no buffer behind */
#define CHECK_FAILED(st_expr, want_st, buf, len)                                                    \
    do {                                                                                            \
        const moetax_status _st = (st_expr);                                                        \
        CHECK_MSG(_st == (want_st), "%s: %s", moetax_status_name(_st), moetax_last_error());         \
        CHECK((buf) == NULL && (len) == 0);                                                         \
    } while (0)

static void limits(void) {
    const char *path = put_bytes("sixteen.txt", "0123456789abcdef", 16);
    char *buf = (char *)1;
    size_t len = 99;
    /* exactly the limit: read whole, NUL-terminated */
    CHECK(moetax_readfile_path(path, &(struct moetax_readfile_params){.max_bytes = 16}, &buf, &len) == MOETAX_OK);
    CHECK(buf && len == 16 && !memcmp(buf, "0123456789abcdef", 17));
    free(buf);
    /* one byte over: refused, naming the file and the limit */
    CHECK_FAILED(moetax_readfile_path(path, &(struct moetax_readfile_params){.max_bytes = 15}, &buf, &len),
                 MOETAX_ERR_LIMIT, buf, len);
    CHECK_MSG(has("sixteen.txt") && has("more than 15 bytes"), "%s", moetax_last_error());
    /* a limit of one byte, and no limit (0) */
    CHECK_FAILED(moetax_readfile_path(path, &(struct moetax_readfile_params){.max_bytes = 1}, &buf, &len),
                 MOETAX_ERR_LIMIT, buf, len);
    CHECK(moetax_readfile_path(path, &(struct moetax_readfile_params){0}, &buf, &len) == MOETAX_OK && len == 16);
    free(buf);
    CHECK(moetax_readfile_path(path, NULL, &buf, &len) == MOETAX_OK && len == 16 && buf[16] == 0);
    free(buf);

    /* larger than the first chunk (the buffer grows), at and over the limit */
    const size_t big = (300 << 10) + 7;
    char *data = malloc(big);
    if (!data) return;
    for (size_t i = 0; i < big; i++) data[i] = (char)('a' + i * 7 % 26);
    path = put_bytes("big.txt", data, big);
    CHECK(moetax_readfile_path(path, &(struct moetax_readfile_params){.max_bytes = big, .text = true}, &buf, &len) ==
          MOETAX_OK);
    CHECK(buf && len == big && !memcmp(buf, data, big) && buf[big] == 0);
    free(buf);
    CHECK_FAILED(moetax_readfile_path(path, &(struct moetax_readfile_params){.max_bytes = big - 1}, &buf, &len),
                 MOETAX_ERR_LIMIT, buf, len);
    free(data);
}

static void empty_missing_directory(void) {
    char *buf = (char *)1;
    size_t len = 99;
    const char *path = put_bytes("empty.txt", "", 0);
    CHECK(moetax_readfile_path(path, &(struct moetax_readfile_params){.max_bytes = 4, .text = true}, &buf, &len) ==
          MOETAX_OK);
    CHECK(buf && len == 0 && buf[0] == 0);
    free(buf);

    CHECK_FAILED(moetax_readfile_path(tu_path("readfile_missing.txt"), NULL, &buf, &len), MOETAX_ERR_IO, buf, len);
    CHECK_MSG(has("missing.txt") && has("cannot open it") && has("No such file"), "%s", moetax_last_error());

    CHECK_FAILED(moetax_readfile_path(tu_workdir, NULL, &buf, &len), MOETAX_ERR_ARG, buf, len);
    CHECK_MSG(has(tu_workdir) && has("is a directory"), "%s", moetax_last_error());
    /* a name of the caller's in the messages */
    CHECK_FAILED(moetax_readfile_path(tu_workdir, &(struct moetax_readfile_params){.name = "--thing x"}, &buf, &len),
                 MOETAX_ERR_ARG, buf, len);
    CHECK_MSG(!strncmp(moetax_last_error(), "--thing x: is a directory", 25), "%s", moetax_last_error());
}

static void text_and_nul(void) {
    char *buf = (char *)1;
    size_t len = 99;
    const char *path = put_bytes("nul.txt", "one\ntwo\nth\0ree\n", 15);
    /* binary: the NUL is part of the bytes */
    CHECK(moetax_readfile_path(path, NULL, &buf, &len) == MOETAX_OK && len == 15 && buf[10] == 0 && buf[15] == 0);
    CHECK(moetax_readfile_check_text("nul.txt", buf, len) == MOETAX_ERR_FORMAT);
    CHECK_MSG(has("nul.txt:3:") && has("byte offset 10") && has("line 3"), "%s", moetax_last_error());
    CHECK(moetax_readfile_check_text("nul.txt", buf, 10) == MOETAX_OK);
    free(buf);
    /* text: the same error from the read */
    CHECK_FAILED(moetax_readfile_path(path, &(struct moetax_readfile_params){.text = true}, &buf, &len),
                 MOETAX_ERR_FORMAT, buf, len);
    CHECK_MSG(has("nul.txt:3:") && has("byte offset 10") && has("NUL byte"), "%s", moetax_last_error());

    /* /dev/zero never ends: the limit stops it, or as text its first byte */
    if (access("/dev/zero", R_OK) == 0) {
        CHECK_FAILED(moetax_readfile_path("/dev/zero", &(struct moetax_readfile_params){.max_bytes = 1 << 20}, &buf,
                                          &len), MOETAX_ERR_LIMIT, buf, len);
        CHECK_MSG(has("/dev/zero: more than 1048576 bytes"), "%s", moetax_last_error());
        CHECK_FAILED(moetax_readfile_path("/dev/zero", &(struct moetax_readfile_params){.text = true}, &buf, &len),
                     MOETAX_ERR_FORMAT, buf, len);
        CHECK_MSG(has("/dev/zero:1:") && has("byte offset 0"), "%s", moetax_last_error());
    }
}

static void streams(void) {
    char *buf = (char *)1;
    size_t len = 99;
    /* a read error: a stream open for writing only */
    FILE *w = fopen(tu_path("readfile_wonly.txt"), "wb");
    CHECK(w != NULL);
    if (w) {
        CHECK_FAILED(moetax_readfile_stream(w, &(struct moetax_readfile_params){.name = "wonly"}, &buf, &len),
                     MOETAX_ERR_IO, buf, len);
        CHECK_MSG(has("wonly: cannot read it: "), "%s", moetax_last_error());
        fclose(w);
    }

    /* a pipe: read to its end from where the stream stands */
    int fd[2];
    CHECK(pipe(fd) == 0);
    const char msg[] = "through a pipe\n";
    CHECK(write(fd[1], msg, sizeof msg - 1) == (ssize_t)(sizeof msg - 1));
    close(fd[1]);
    FILE *r = fdopen(fd[0], "rb");
    CHECK(r && fgetc(r) == 't');
    if (r) {
        CHECK(moetax_readfile_stream(r, NULL, &buf, &len) == MOETAX_OK);
        CHECK(buf && len == sizeof msg - 2 && !strcmp(buf, msg + 1));
        free(buf);
        fclose(r);
    }

    /* a FIFO by its path, written by a child; over the limit it is refused like a file */
    const char *fifo = tu_path("readfile_fifo");
    unlink(fifo);
    CHECK(mkfifo(fifo, 0600) == 0);
    for (int over = 0; over < 2; over++) {
        const pid_t pid = fork();
        if (pid == 0) {
            const int o = open(fifo, O_WRONLY);
            const char line[] = "0123456789\n";
            for (int i = 0; o >= 0 && i < 1000; i++)
                if (write(o, line, sizeof line - 1) < 0) break; /* EPIPE once the reader stops */
            _exit(0);
        }
        const size_t max = over ? 5000 : 11000;
        const moetax_status st = moetax_readfile_path(fifo, &(struct moetax_readfile_params){.max_bytes = max}, &buf,
                                                      &len);
        if (over) CHECK_FAILED(st, MOETAX_ERR_LIMIT, buf, len);
        else {
            CHECK_MSG(st == MOETAX_OK && len == 11000 && buf && !strncmp(buf + 10989, "0123456789\n", 12), "%s",
                      moetax_last_error());
            free(buf);
        }
        int status = 0;
        if (pid > 0) waitpid(pid, &status, 0);
    }
    unlink(fifo);

    /* standard input, named as such */
    const char *in = put_bytes("stdin.txt", "from stdin", 10);
    if (freopen(in, "rb", stdin)) {
        CHECK(moetax_readfile_stream(stdin, &(struct moetax_readfile_params){.max_bytes = 10}, &buf, &len) ==
              MOETAX_OK);
        CHECK(buf && len == 10 && !strcmp(buf, "from stdin"));
        free(buf);
        rewind(stdin);
        CHECK_FAILED(moetax_readfile_stream(stdin, &(struct moetax_readfile_params){.max_bytes = 9}, &buf, &len),
                     MOETAX_ERR_LIMIT, buf, len);
        CHECK_MSG(has("standard input: more than 9 bytes"), "%s", moetax_last_error());
    }
    /* a directory as standard input */
    if (freopen(tu_workdir, "rb", stdin))
        CHECK_FAILED(moetax_readfile_stream(stdin, NULL, &buf, &len), MOETAX_ERR_ARG, buf, len);
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    limits();
    empty_missing_directory();
    text_and_nul();
    streams();
    return tu_finish("test_readfile");
}
