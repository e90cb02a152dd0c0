#include "cli.h"
#include "moetax/membw.h"
#include "moetax/model.h"
#include "moetax/outfile.h"
#include "moetax/pool.h"
#include "moetax/readfile.h"
#include "moetax/tokenizer.h"

#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <dirent.h>

int cli_fail(const char *cmd, moetax_status st) {
    const char *msg = moetax_last_error();
    fprintf(stderr, "moetax %s: error: %s%s(%s)\n", cmd, msg, msg[0] ? " " : "", moetax_status_name(st));
    return 1;
}

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "moetax %s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n(see 'moetax %s --help')\n", cmd);
    va_end(ap);
    return 2;
}

bool cli_flag(char **argv, int i, const char *s, const char *l) {
    return (s && strcmp(argv[i], s) == 0) || (l && strcmp(argv[i], l) == 0);
}

bool cli_opt(int argc, char **argv, int *i, const char *s, const char *l, const char **val, bool *err) {
    const char *a = argv[*i];
    if (l) {
        size_t n = strlen(l);
        if (strncmp(a, l, n) == 0 && a[n] == '=') { *val = a + n + 1; return true; }
    }
    if (!cli_flag(argv, *i, s, l)) return false;
    if (*i + 1 >= argc) {
        fprintf(stderr, "moetax: option %s needs a value\n", a);
        *err = true;
        return true;
    }
    *val = argv[++*i];
    return true;
}

bool cli_parse_i64(const char *s, int64_t *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end) return false;
    *out = v;
    return true;
}

bool cli_parse_experts_used(const char *s, int *out) {
    int64_t k = 0;
    if (!cli_parse_i64(s, &k) || k < 1 || k > 256) return false;
    *out = (int)k;
    return true;
}

bool cli_parse_f64(const char *s, double *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !isfinite(v)) return false;
    *out = v;
    return true;
}

bool cli_parse_size(const char *s, uint64_t *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0 || !isfinite(v)) return false;
    double mul = 1;
    if (*end) {
        char c = (char)(*end | 0x20);
        if (c == 'k') mul = 1024.0;
        else if (c == 'm') mul = 1024.0 * 1024;
        else if (c == 'g') mul = 1024.0 * 1024 * 1024;
        else if (c == 't') mul = 1024.0 * 1024 * 1024 * 1024;
        else if (c == 'b' && end[1] == 0) mul = 1;
        else return false;
        end++;
        if (*end && strcasecmp(end, "b") != 0 && strcasecmp(end, "ib") != 0) return false;
    }
    double b = v * mul;
    if (b > 1.8e19) return false;
    *out = (uint64_t)b;
    return true;
}

int cli_parse_int_list(const char *s, int64_t *out, int max) {
    int n = 0;
    const char *p = s;
    while (*p) {
        char buf[64];
        size_t len = strcspn(p, ",");
        if (len == 0 || len >= sizeof buf || n >= max) return -1;
        memcpy(buf, p, len);
        buf[len] = 0;
        if (!cli_parse_i64(buf, &out[n])) return -1;
        n++;
        p += len;
        if (*p == ',' && !*++p) return -1; /* a trailing comma: an item left out */
    }
    return n;
}

int cli_parse_threads(const char *cmd, const char *s, int64_t *out, int max) {
    int n = cli_parse_int_list(s, out, max);
    if (n <= 0) {
        cli_usage_error(cmd, "bad thread list '%s' (expected e.g. 1,2)", s);
        return -1;
    }
    for (int k = 0; k < n; k++)
        if (out[k] < 1 || out[k] > MOETAX_POOL_MAX_THREADS) {
            cli_usage_error(cmd, "thread count %lld out of range 1..%d", (long long)out[k], MOETAX_POOL_MAX_THREADS);
            return -1;
        }
    return n;
}

double cli_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void cli_progress_init(cli_progress *p, const char *label, uint64_t total) {
    const char *force = getenv("MOETAX_PROGRESS");
    p->label = label;
    p->total = total ? total : 1;
    p->t_start = p->t_last = cli_now();
    p->enabled = force ? strcmp(force, "0") != 0 : isatty(2);
}

void cli_progress_update(cli_progress *p, uint64_t done) {
    if (!p->enabled) return;
    double t = cli_now();
    if (t - p->t_last < 0.1 && done < p->total) return;
    p->t_last = t;
    double frac = (double)done / (double)p->total;
    if (frac > 1) frac = 1;
    int width = 30, fill = (int)(frac * width);
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
    bar[width] = 0;
    double el = t - p->t_start;
    double eta = frac > 0 ? el / frac - el : 0;
    fprintf(stderr, "\r%s [%s] %5.1f%%  %.0fs elapsed, %.0fs left ", p->label, bar, 100 * frac, el, eta);
    fflush(stderr);
}

void cli_progress_done(cli_progress *p) {
    if (!p->enabled) return;
    cli_progress_update(p, p->total);
    fprintf(stderr, "\n");
}

const char *cli_default_model_path(void) {
    const char *e = getenv("MOETAX_MODEL");
    if (e && *e) return e;
    static const char rel[] = "models/" CLI_DEFAULT_MODEL;
    if (access(rel, R_OK) == 0) return rel;
    /* not run from the checkout: the repository the executable was built in
     * (build/moetax -> ../models/) */
    static char beside[4096];
    ssize_t n = readlink("/proc/self/exe", beside, sizeof beside - 1);
    if (n > 0) {
        beside[n] = 0;
        for (int up = 0; up < 2; up++) {
            char *slash = strrchr(beside, '/');
            if (!slash) break;
            *slash = 0;
        }
        size_t l = strlen(beside);
        if (l + sizeof rel + 1 < sizeof beside) {
            beside[l] = '/';
            memcpy(beside + l + 1, rel, sizeof rel);
            if (access(beside, R_OK) == 0) return beside;
        }
    }
    return rel;
}

moetax_status cli_error_at(const char *path, moetax_status st) {
    char why[512]; /* the message is rewritten: copied out of the buffer it lives in first */
    snprintf(why, sizeof why, "%s", moetax_last_error());
    return moetax_error(st, "%s: %s", path, why);
}

moetax_status cli_read_file(const char *path, uint64_t max_bytes, char **text, size_t *len) {
    if (!max_bytes) max_bytes = CLI_MAX_INPUT_DEFAULT;
    const bool std_in = !strcmp(path, "-");
    const struct moetax_readfile_params p = {.max_bytes = max_bytes < SIZE_MAX ? (size_t)max_bytes : SIZE_MAX,
                                             .name = std_in ? "standard input" : path};
    const moetax_status st =
        std_in ? moetax_readfile_stream(stdin, &p, text, len) : moetax_readfile_path(path, &p, text, len);
    if (st != MOETAX_ERR_LIMIT) return st;
    if (max_bytes >= (1 << 20))
        return moetax_error(st, "%s: more than %.0f MiB of text (%llu bytes; --max-input-bytes raises the limit)", p.name,
                            (double)max_bytes / (1 << 20), (unsigned long long)max_bytes);
    return moetax_error(st, "%s: more than %llu bytes of text (--max-input-bytes raises the limit)", p.name,
                        (unsigned long long)max_bytes);
}

bool cli_capacity_factor_ok(double *c) {
    if (*c > 0 && (float)*c == 0) return false; /* below half of the smallest float (about 7e-46) */
    if (*c > FLT_MAX) *c = INFINITY;
    return true;
}

bool cli_max_input_opt(const char *cmd, int argc, char **argv, int *i, uint64_t *max_bytes, bool *err) {
    const char *v = NULL;
    if (!cli_opt(argc, argv, i, NULL, "--max-input-bytes", &v, err)) return false;
    if (*err) return true;
    uint64_t b;
    if (!cli_parse_size(v, &b) || b < 1 || b > ((uint64_t)1 << 40)) {
        cli_usage_error(cmd, "--max-input-bytes: '%s' is not a size from 1 to 1T (e.g. 64K, 512M, 2G)", v);
        *err = true;
        return true;
    }
    *max_bytes = b;
    return true;
}

bool cli_cache_type_parse(const char *s, enum moetax_type *type) {
    static const enum moetax_type types[] = {MOETAX_TYPE_F32, MOETAX_TYPE_F16, MOETAX_TYPE_Q8_0};
    for (size_t k = 0; s && k < sizeof types / sizeof types[0]; k++)
        if (!strcmp(s, moetax_type_name(types[k]))) {
            *type = types[k];
            return true;
        }
    return false;
}

bool cli_cache_type_opt(const char *cmd, int argc, char **argv, int *i, enum moetax_type *type, bool *err) {
    const char *v = NULL;
    if (!cli_opt(argc, argv, i, NULL, "--cache-type", &v, err)) return false;
    if (*err) return true;
    if (!cli_cache_type_parse(v, type)) {
        cli_usage_error(cmd, "--cache-type: '%s': expected f32, f16 or q8_0", v);
        *err = true;
    }
    return true;
}

const char *cli_mla_prefill_name(enum moetax_attn_prefill mode) {
    return mode == MOETAX_ATTN_PREFILL_AUTO ? "auto" : mode == MOETAX_ATTN_PREFILL_DECOMPRESSED ? "decompressed" : "absorbed";
}

bool cli_mla_prefill_parse(const char *s, enum moetax_attn_prefill *mode) {
    const enum moetax_attn_prefill all[] = {MOETAX_ATTN_PREFILL_ABSORBED, MOETAX_ATTN_PREFILL_AUTO,
                                            MOETAX_ATTN_PREFILL_DECOMPRESSED};
    for (size_t i = 0; s && i < sizeof all / sizeof all[0]; i++)
        if (!strcmp(s, cli_mla_prefill_name(all[i]))) {
            *mode = all[i];
            return true;
        }
    return false;
}

bool cli_mla_prefill_opt(const char *cmd, int argc, char **argv, int *i, enum moetax_attn_prefill *mode, bool *err) {
    const char *v = NULL;
    if (!cli_opt(argc, argv, i, NULL, "--mla-prefill", &v, err)) return false;
    if (*err) return true;
    if (!cli_mla_prefill_parse(v, mode)) {
        cli_usage_error(cmd, "--mla-prefill: '%s': expected auto, absorbed or decompressed", v);
        *err = true;
    }
    return true;
}

moetax_status cli_check_outputs(const char *const *paths, int n) {
    for (int k = 0; k < n; k++) {
        if (!paths[k]) continue;
        moetax_status st = moetax_outfile_check(paths[k], 0);
        if (st) return st;
    }
    return MOETAX_OK;
}

/* path with its folder resolved (./x, dir/../x and x are one name), into out; the path itself if the
 * folder cannot be resolved */
static void cli_canonical(const char *path, char *out, size_t n) {
    const char *slash = strrchr(path, '/');
    char dir[PATH_MAX], real[PATH_MAX];
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - path) + (slash == path) : 1, slash ? path : ".");
    if (realpath(dir, real)) snprintf(out, n, "%s/%s", real, slash ? slash + 1 : path);
    else snprintf(out, n, "%s", path);
}

/* a and b name the same file: by device and inode when both exist, else by their resolved names */
static bool cli_same_path(const char *a, const char *b) {
    bool same = false;
    struct stat sa, sb;
    if (stat(a, &sa) == 0 && stat(b, &sb) == 0) return moetax_same_file(a, b, &same) == MOETAX_OK && same;
    char ca[PATH_MAX + 256], cb[PATH_MAX + 256];
    cli_canonical(a, ca, sizeof ca);
    cli_canonical(b, cb, sizeof cb);
    return !strcmp(ca, cb);
}

static int g_argc;
static char **g_argv;

void cli_note_argv(int argc, char **argv) {
    g_argc = argc;
    g_argv = argv;
}

/* The file that argv[*i] names as an input option's value (advancing *i past a separate value), or
 * NULL where argv[*i] is no input option. */
static const char *cli_argv_input(int *i, const char **opt) {
    static const char *const names[] = {"-m", "--model", "-f", "--file", "--predictor", "--warm", "--config",
                                        "--calib", "--twin", "--dense-twin-of", "--placement", "--ep-load"};
    const char *a = g_argv[*i];
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        const size_t n = strlen(names[k]);
        if (strncmp(a, names[k], n)) continue;
        *opt = names[k];
        if (a[n] == '=' && names[k][1] == '-') return a + n + 1;
        if (a[n] == '\0' && *i + 1 < g_argc) return g_argv[++*i];
    }
    return NULL;
}

moetax_status cli_check_io(const char *const *outs, int n_out, const char *const *ins, int n_in) {
    moetax_status st = cli_check_outputs(outs, n_out);
    for (int k = 0; !st && k < n_out; k++) {
        if (!outs[k]) continue;
        for (int i = 0; !st && i < n_in; i++)
            if (ins[i] && cli_same_path(ins[i], outs[k]))
                st = moetax_error(MOETAX_ERR_ARG, "the output %s is the input %s: writing it would replace it", outs[k],
                                  ins[i]);
        for (int a = 2; !st && a < g_argc; a++) {
            const char *opt = NULL, *in = cli_argv_input(&a, &opt);
            if (in && *in && cli_same_path(in, outs[k]))
                st = moetax_error(MOETAX_ERR_ARG, "the output %s is the input %s (%s): writing it would replace it",
                                  outs[k], in, opt);
        }
        for (int j = 0; !st && j < k; j++)
            if (outs[j] && cli_same_path(outs[j], outs[k]))
                st = moetax_error(MOETAX_ERR_ARG, "the outputs %s and %s are the same file: one would replace the "
                                  "other", outs[j], outs[k]);
    }
    return st;
}

moetax_status cli_encode(const struct moetax_tokenizer *tok, const char *text, size_t len, bool bos, int64_t extra,
                         int32_t **ids, int64_t *n) {
    *ids = NULL;
    *n = 0;
    int64_t need = 0;
    moetax_status st = moetax_tokenizer_encode(tok, text, len, bos, NULL, 0, &need);
    if (st && st != MOETAX_ERR_LIMIT) return st;
    if (!(*ids = malloc(sizeof(int32_t) * (size_t)(need + extra + 1))))
        return moetax_error(MOETAX_ERR_NOMEM, "out of memory for %lld token ids", (long long)(need + extra));
    if ((st = moetax_tokenizer_encode(tok, text, len, bos, *ids, need + extra + 1, n))) {
        free(*ids);
        *ids = NULL;
    }
    return st;
}

int cli_token_bytes(const struct moetax_tokenizer *tok, int32_t t, char *buf, int cap, char **out) {
    *out = buf;
    int nb = moetax_tokenizer_token_to_bytes(tok, t, buf, cap);
    if (nb >= 0) return nb;
    char *big = malloc((size_t)-nb); /* a token longer than buf (it was dropped from the output) */
    if (!big || (nb = moetax_tokenizer_token_to_bytes(tok, t, big, -nb)) < 0) {
        free(big);
        return 0;
    }
    *out = big;
    return nb;
}

bool cli_warn_past_train(const char *cmd, const struct moetax_model *m, int64_t positions, const char *what) {
    const int64_t train = m->hp.n_ctx_train;
    if (train <= 0 || positions <= train) return false;
    fprintf(stderr, "moetax %s: warning: %s reaches position %lld, past the %lld positions the model was trained on: "
            "what it computes there means little\n", cmd, what, (long long)positions - 1, (long long)train);
    return true;
}

moetax_status cli_check_logits(const float *row, int64_t n, int64_t pos) {
    for (int64_t v = 0; v < n; v++)
        if (!isfinite(row[v]))
            return moetax_error(MOETAX_ERR_NUMERIC, "the logits of position %lld are not finite (token %lld is %s): "
                                "the model's weights or its input give NaN or infinity", (long long)pos, (long long)v,
                                isnan(row[v]) ? "NaN" : "infinite");
    return MOETAX_OK;
}

json_t *cli_jnum(double x) { return isfinite(x) ? json_real(x) : json_null(); }

json_t *cli_jstr(const char *s) {
    json_t *j = s ? json_string(s) : NULL;
    return j ? j : json_null();
}

json_t *cli_jobj(const char *fmt, ...) {
    json_t *o = json_object();
    va_list ap;
    va_start(ap, fmt);
    for (const char *c = fmt; *c; c++) {
        const char *k = va_arg(ap, const char *);
        json_t *v;
        switch (*c) {
        case 's': v = cli_jstr(va_arg(ap, const char *)); break;
        case 'i': v = json_integer(va_arg(ap, int)); break;
        case 'I': v = json_integer((json_int_t)va_arg(ap, int64_t)); break;
        case 'f': v = cli_jnum(va_arg(ap, double)); break;
        case 'b': v = json_boolean(va_arg(ap, int)); break;
        case 'o': v = va_arg(ap, json_t *); break;
        default: MOETAX_ASSERT(!"cli_jobj: unknown format letter"); v = NULL;
        }
        if (!o || !v || json_object_set_new(o, k, v) != 0) { /* set_new drops v on failure */
            if (!o && v) json_decref(v);
            json_decref(o);
            o = NULL;
        }
    }
    va_end(ap);
    return o;
}

moetax_status cli_json_print(FILE *f, json_t *o) {
    if (!o) return moetax_error(MOETAX_ERR_NOMEM, "out of memory for the JSON output");
    int rc = json_dumpf(o, f, JSON_COMPACT | JSON_REAL_PRECISION(10));
    json_decref(o);
    if (rc != 0 || fputc('\n', f) == EOF || fflush(f) != 0)
        return moetax_error(MOETAX_ERR_IO, "cannot write the JSON output: %s", strerror(errno));
    return MOETAX_OK;
}

static int cmp_f64(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double cli_percentile(double *v, int n, double p) {
    if (n <= 0) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_f64);
    return v[(int)(p * (n - 1) + 0.5)];
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

moetax_status cli_list_inputs(const char *path, char ***out, int *n_out) {
    *out = NULL;
    *n_out = 0;
    struct stat sb;
    if (stat(path, &sb)) return moetax_error(MOETAX_ERR_IO, "%s: %s", path, strerror(errno));
    char **v = NULL;
    int n = 0, cap = 0;
    if (!S_ISDIR(sb.st_mode)) {
        v = malloc(sizeof *v);
        if (!v || !(v[0] = strdup(path))) { free(v); return moetax_error(MOETAX_ERR_NOMEM, "out of memory"); }
        *out = v;
        *n_out = 1;
        return MOETAX_OK;
    }
    DIR *d = opendir(path);
    if (!d) return moetax_error(MOETAX_ERR_IO, "%s: cannot open the folder: %s", path, strerror(errno));
    struct dirent *e;
    moetax_status st = MOETAX_OK;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        size_t l = strlen(path) + strlen(e->d_name) + 2;
        char *p = malloc(l);
        if (!p) { st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); break; }
        snprintf(p, l, "%s/%s", path, e->d_name);
        if (stat(p, &sb) || !S_ISREG(sb.st_mode)) { free(p); continue; }
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            char **nv = realloc(v, sizeof *v * (size_t)cap);
            if (!nv) { free(p); st = moetax_error(MOETAX_ERR_NOMEM, "out of memory"); break; }
            v = nv;
        }
        v[n++] = p;
    }
    closedir(d);
    if (!st && n == 0) st = moetax_error(MOETAX_ERR_ARG, "%s: the folder holds no regular files", path);
    if (st) {
        for (int i = 0; i < n; i++) free(v[i]);
        free(v);
        return st;
    }
    qsort(v, (size_t)n, sizeof *v, cmp_str);
    *out = v;
    *n_out = n;
    return MOETAX_OK;
}

bool cli_paired_bad(double r) { return isfinite(r) && r > CLI_PAIRED_MAX; }

const char *cli_paired_cell(double r, char *buf, size_t n) {
    if (cli_paired_bad(r)) snprintf(buf, n, "error (%.1f%%)", 100 * r);
    else snprintf(buf, n, "%.1f%%", 100 * r);
    return buf;
}

bool cli_paired_json(json_t *o, const char *name, double r) {
    char key[96];
    const bool bad = cli_paired_bad(r);
    int rc = json_object_set_new(o, name, bad ? json_null() : cli_jnum(r));
    snprintf(key, sizeof key, "%s_raw", name);
    rc |= json_object_set_new(o, key, cli_jnum(r));
    snprintf(key, sizeof key, "%s_error", name);
    rc |= json_object_set_new(o, key, json_boolean(bad));
    return rc == 0;
}

void cli_paired_note(FILE *f) {
    fprintf(f, "error: a paired ratio above %.0f%% is a measurement error, not a figure: the run read faster than a "
               "plain read of memory just before it, so that read was slowed (another process, page faults) or the "
               "run's bytes came partly from the caches\n",
            100 * CLI_PAIRED_MAX);
}

/* MOETAX_TEST_READ_PASS_SCALE's factor for pass i of a pair ("A" both, "A,B" the first A, the second B) */
static double read_pass_scale(int i) {
    const char *v = getenv("MOETAX_TEST_READ_PASS_SCALE");
    if (!v || !*v) return 1;
    char *end;
    double k = strtod(v, &end);
    if (*end == ',' && i == 1) k = strtod(end + 1, &end);
    else if (*end == ',') end += strlen(end);
    return *end == 0 && k > 0 && isfinite(k) ? k : 1;
}

double cli_read_pass_gbps(double gbps) { return gbps * read_pass_scale(0); }

double cli_read_pass(struct moetax_membw_probe *probe) {
    double best = 0;
    for (int i = 0; i < 2; i++) {
        double g = 0;
        if (moetax_membw_probe_pass(probe, &g) != MOETAX_OK) continue;
        g *= read_pass_scale(i);
        if (g > best) best = g;
    }
    return best;
}
