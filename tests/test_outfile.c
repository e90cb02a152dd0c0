// ctest-labels: unit
/* test_outfile.c - safe output files (moetax/outfile.h): a new file and a replaced
 * one (content, permission bits), symbolic links followed (the link kept),
 * targets that are not regular files refused (character device, FIFO,
 * directory), a missing directory, the free-space check, a write error (a file
 * size limit, and a full tmpfs where it can be mounted) leaving the target as it
 * was and no temporary file behind, the signal cleanup, and same-file by inode. */
#include "moetax/outfile.h"
#include "testutil.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[1024];

static const char *P(const char *name) {
    static char buf[8][1200];
    static int k;
    char *b = buf[k++ % 8];
    snprintf(b, sizeof buf[0], "%s/%s", g_dir, name);
    return b;
}

static void put_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (f) { fputs(text, f); fclose(f); }
}

static bool has_text(const char *path, const char *text) {
    char buf[256] = "";
    FILE *f = fopen(path, "r");
    if (!f) return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    return !strcmp(buf, text);
}

/* entries of dir whose name contains ".tmp." */
static int count_tmp(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    if (!d) return -1;
    struct dirent *e;
    while ((e = readdir(d))) n += strstr(e->d_name, ".tmp.") != NULL;
    closedir(d);
    return n;
}

static moetax_status write_all(const char *path, const char *text) {
    struct moetax_outfile *o;
    moetax_status st = moetax_outfile_open(path, &o);
    if (st) return st;
    fputs(text, moetax_outfile_file(o));
    return moetax_outfile_commit(o);
}

static void test_basic(void) {
    const char *a = P("a.txt");
    mode_t um = umask(027);
    CHECK_EQ_INT(write_all(a, "one"), MOETAX_OK);
    struct stat sb;
    CHECK(stat(a, &sb) == 0 && (sb.st_mode & 0777) == 0640);
    CHECK(has_text(a, "one"));
    umask(um);
    /* replaced: new content, old mode */
    chmod(a, 0604);
    CHECK_EQ_INT(write_all(a, "two"), MOETAX_OK);
    CHECK(stat(a, &sb) == 0 && (sb.st_mode & 0777) == 0604);
    CHECK(has_text(a, "two"));
    /* abort: the target as it was, no temporary file */
    struct moetax_outfile *o;
    CHECK_EQ_INT(moetax_outfile_open(a, &o), MOETAX_OK);
    fputs("three", moetax_outfile_file(o));
    CHECK(access(moetax_outfile_tmp_path(o), F_OK) == 0);
    moetax_outfile_abort(o);
    CHECK(has_text(a, "two"));
    CHECK_EQ_INT(count_tmp(g_dir), 0);
    /* the signal cleanup removes a temporary file still open */
    CHECK_EQ_INT(moetax_outfile_open(a, &o), MOETAX_OK);
    char tmp[1200];
    snprintf(tmp, sizeof tmp, "%s", moetax_outfile_tmp_path(o));
    moetax_outfile_cleanup_signal();
    CHECK(access(tmp, F_OK) != 0);
    moetax_outfile_abort(o);
    CHECK(has_text(a, "two"));
}

static void test_links(void) {
    const char *t = P("target.txt"), *l = P("link.txt");
    put_file(t, "old");
    CHECK(symlink("target.txt", l) == 0); /* relative, resolved against the link's directory */
    CHECK_EQ_INT(write_all(l, "new"), MOETAX_OK);
    struct stat sb;
    CHECK(lstat(l, &sb) == 0 && S_ISLNK(sb.st_mode));
    CHECK(has_text(t, "new"));
    /* a chain of two links, the last one dangling: its target is created */
    CHECK(symlink("link2.txt", P("link1.txt")) == 0);
    CHECK(symlink(P("created.txt"), P("link2.txt")) == 0);
    CHECK_EQ_INT(write_all(P("link1.txt"), "made"), MOETAX_OK);
    CHECK(has_text(P("created.txt"), "made"));
    CHECK(lstat(P("link2.txt"), &sb) == 0 && S_ISLNK(sb.st_mode));
    /* a loop */
    CHECK(symlink("loop_b", P("loop_a")) == 0);
    CHECK(symlink("loop_a", P("loop_b")) == 0);
    CHECK(write_all(P("loop_a"), "x") == MOETAX_ERR_IO && strstr(moetax_last_error(), "symbolic links"));
    /* a link to /dev/null is refused like /dev/null */
    CHECK(symlink("/dev/null", P("null_link")) == 0);
    moetax_status st = write_all(P("null_link"), "x");
    CHECK_MSG(st == MOETAX_ERR_ARG && strstr(moetax_last_error(), "/dev/null") &&
              strstr(moetax_last_error(), "character device"), "%s", moetax_last_error());
}

static void test_refused(void) {
    struct stat sb;
    /* /dev/null stays a device (the old writer renamed over it, as root) */
    CHECK(moetax_outfile_check("/dev/null", 0) == MOETAX_ERR_ARG && strstr(moetax_last_error(), "character device"));
    CHECK(write_all("/dev/null", "x") == MOETAX_ERR_ARG);
    CHECK(stat("/dev/null", &sb) == 0 && S_ISCHR(sb.st_mode));
    CHECK(moetax_outfile_check("/dev/full", 0) == MOETAX_ERR_ARG);
    const char *fifo = P("fifo");
    CHECK(mkfifo(fifo, 0600) == 0);
    CHECK_MSG(moetax_outfile_check(fifo, 0) == MOETAX_ERR_ARG && strstr(moetax_last_error(), "FIFO"), "%s",
              moetax_last_error());
    CHECK(stat(fifo, &sb) == 0 && S_ISFIFO(sb.st_mode));
    CHECK(moetax_outfile_check(g_dir, 0) == MOETAX_ERR_ARG && strstr(moetax_last_error(), "directory"));
    CHECK(moetax_outfile_check(P("nodir/"), 0) != MOETAX_OK);
    /* a missing directory: named, before any work */
    moetax_status st = moetax_outfile_check(P("missing/dir/x.json"), 0);
    CHECK_MSG(st == MOETAX_ERR_IO && strstr(moetax_last_error(), "missing/dir"), "%s", moetax_last_error());
    CHECK(moetax_outfile_check("", 0) == MOETAX_ERR_ARG);
    /* free space: no file system has 2^62 bytes free; the check leaves nothing behind */
    st = moetax_outfile_check(P("big.bin"), (uint64_t)1 << 62);
    CHECK_MSG(st == MOETAX_ERR_LIMIT && strstr(moetax_last_error(), "free"), "%s", moetax_last_error());
    CHECK_EQ_INT(moetax_outfile_check(P("small.bin"), 4096), MOETAX_OK);
    CHECK(access(P("small.bin"), F_OK) != 0);
    CHECK_EQ_INT(count_tmp(g_dir), 0);
}

/* A write error in the middle: the target keeps its content, no temporary file stays. */
static void test_write_error(void) {
    const char *a = P("limited.bin");
    put_file(a, "keep");
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    lim = old;
    lim.rlim_cur = 64 << 10;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN); /* EFBIG instead of the signal */
    CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0);
    struct moetax_outfile *o;
    CHECK_EQ_INT(moetax_outfile_open(a, &o), MOETAX_OK);
    if (o) {
        static char block[4096];
        for (int i = 0; i < 64; i++) fwrite(block, 1, sizeof block, moetax_outfile_file(o));
        moetax_status st = moetax_outfile_commit(o);
        CHECK_MSG(st == MOETAX_ERR_IO && strstr(moetax_last_error(), "limited.bin"), "%s", moetax_last_error());
    }
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    CHECK(has_text(a, "keep"));
    CHECK_EQ_INT(count_tmp(g_dir), 0);

    /* a full file system (a 64 KiB tmpfs; needs root, skipped otherwise) */
    const char *mnt = P("tmpfs");
    mkdir(mnt, 0700);
    if (mount("tmpfs", mnt, "tmpfs", 0, "size=64k") != 0) {
        fprintf(stderr, "test_outfile: no tmpfs (%s): full-disk case skipped\n", strerror(errno));
        return;
    }
    char full[1200];
    snprintf(full, sizeof full, "%s/out.bin", mnt);
    put_file(full, "keep");
    CHECK_EQ_INT(moetax_outfile_open(full, &o), MOETAX_OK);
    if (o) {
        static char block[4096];
        for (int i = 0; i < 64; i++) fwrite(block, 1, sizeof block, moetax_outfile_file(o));
        moetax_status st = moetax_outfile_commit(o);
        CHECK_MSG(st == MOETAX_ERR_IO && strstr(moetax_last_error(), "No space"), "%s", moetax_last_error());
    }
    CHECK(has_text(full, "keep"));
    CHECK_EQ_INT(count_tmp(mnt), 0);
    CHECK(moetax_outfile_check(full, 1 << 20) == MOETAX_ERR_LIMIT);
    umount(mnt);
}

static void test_same_file(void) {
    const char *a = P("same.gguf");
    put_file(a, "x");
    bool same = false;
    char other[2400];
    /* ./../<dir>/same.gguf: another string, the same inode */
    const char *base = strrchr(g_dir, '/') + 1;
    snprintf(other, sizeof other, "%s/./../%s/same.gguf", g_dir, base);
    CHECK(moetax_same_file(a, other, &same) == MOETAX_OK && same);
    CHECK(symlink(a, P("same_link.gguf")) == 0);
    CHECK(moetax_same_file(a, P("same_link.gguf"), &same) == MOETAX_OK && same);
    CHECK(link(a, P("same_hard.gguf")) == 0);
    CHECK(moetax_same_file(a, P("same_hard.gguf"), &same) == MOETAX_OK && same);
    put_file(P("other.gguf"), "y");
    CHECK(moetax_same_file(a, P("other.gguf"), &same) == MOETAX_OK && !same);
    CHECK(moetax_same_file(a, P("not_there.gguf"), &same) == MOETAX_OK && !same);
    CHECK(moetax_same_file(P("not_there.gguf"), a, &same) == MOETAX_ERR_IO);
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    snprintf(g_dir, sizeof g_dir, "%s/outfile.%d", tu_workdir, (int)getpid());
    char cmd[2400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", g_dir, g_dir);
    if (tu_run(cmd, NULL) != 0) { fprintf(stderr, "cannot make %s\n", g_dir); return 1; }
    test_basic();
    test_links();
    test_refused();
    test_write_error();
    test_same_file();
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    tu_run(cmd, NULL);
    return tu_finish("test_outfile");
}
