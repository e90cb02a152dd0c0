// ctest-labels: unit
/* test_printable.c - bytes made safe to show (core/printable.h): control bytes and DEL as '?',
 * bytes from 0x80 kept or (MOETAX_PRINTABLE_ASCII) replaced, the bounds of source and destination,
 * a NUL ending the source, in place; and the report's HTML text, which maps DEL too. */
#include "core/printable.h"
#include "moetax/report.h"
#include "testutil.h"

#include <stdlib.h>
#include <string.h>

static void copies(void) {
    char d[64];
    CHECK(moetax_printable(d, sizeof d, "plain text 123", SIZE_MAX, 0) == 14 && !strcmp(d, "plain text 123"));
    /* ESC, BEL, newline, tab, CR, DEL: each one '?' */
    CHECK(moetax_printable(d, sizeof d, "a\x1b[2J\x07" "b\n\t\r\x7f" "c", SIZE_MAX, 0) == 12);
    CHECK_MSG(!strcmp(d, "a?[2J?b????c"), "%s", d);
    /* UTF-8 kept; as ASCII every byte from 0x80 is '?' */
    CHECK(moetax_printable(d, sizeof d, "caf\xc3\xa9 \xff", SIZE_MAX, 0) == 7 && !strcmp(d, "caf\xc3\xa9 \xff"));
    CHECK(moetax_printable(d, sizeof d, "caf\xc3\xa9 \xff", SIZE_MAX, MOETAX_PRINTABLE_ASCII) == 7);
    CHECK_MSG(!strcmp(d, "caf?? ?"), "%s", d);
    CHECK(moetax_printable(d, sizeof d, "\x1b\x7f", SIZE_MAX, MOETAX_PRINTABLE_ASCII) == 2 && !strcmp(d, "??"));
    /* C1 controls in UTF-8 (U+009B CSI, U+009D OSC, U+009C ST): both bytes '?'; U+00A0, U+00E9 kept */
    CHECK(moetax_printable(d, sizeof d, "x\xc2\x9b" "2J\xc2\x9d" "0;t\xc2\x9cy", SIZE_MAX, 0) == 13);
    CHECK_MSG(!strcmp(d, "x??2J??0;t??y"), "%s", d);
    CHECK(moetax_printable(d, sizeof d, "\xc2\xa0\xc3\xa9\xc2\x80", SIZE_MAX, 0) == 6);
    CHECK_MSG(!strcmp(d, "\xc2\xa0\xc3\xa9??"), "%s", d);
    /* the source's bound cuts the pair: its first byte alone is kept (an incomplete sequence) */
    CHECK(moetax_printable(d, sizeof d, "a\xc2\x9b", 2, 0) == 2 && !strcmp(d, "a\xc2"));
}

static void bounds(void) {
    char d[8];
    /* the destination's bound: 7 bytes and the NUL; the count says more was there */
    const char *long_src = "0123456789";
    const size_t k = moetax_printable(d, sizeof d, long_src, SIZE_MAX, 0);
    CHECK(k == 7 && !strcmp(d, "0123456") && long_src[k] != 0);
    /* the source's bound: no NUL needed after it */
    const char raw[4] = {'a', '\x01', 'b', 'c'};
    CHECK(moetax_printable(d, sizeof d, raw, 3, 0) == 3 && !strcmp(d, "a?b"));
    CHECK(moetax_printable(d, sizeof d, raw, 0, 0) == 0 && d[0] == 0);
    /* a NUL ends the source */
    CHECK(moetax_printable(d, sizeof d, "ab\0cd", 5, 0) == 2 && !strcmp(d, "ab"));
    /* a destination of one byte holds the NUL alone; of none, nothing is written */
    CHECK(moetax_printable(d, 1, "abc", SIZE_MAX, 0) == 0 && d[0] == 0);
    d[0] = 'x';
    CHECK(moetax_printable(d, 0, "abc", SIZE_MAX, 0) == 0 && d[0] == 'x');
    /* in place */
    char name[16] = "m\x1b]0;x\x07";
    CHECK(moetax_printable(name, sizeof name, name, SIZE_MAX, 0) == 7 && !strcmp(name, "m?]0;x?"));
    CHECK(moetax_is_control(0) && moetax_is_control(0x1f) && moetax_is_control(0x7f));
    CHECK(!moetax_is_control(' ') && !moetax_is_control('~') && !moetax_is_control(0x80));
}

static void html(void) {
    char *out = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&out, &len);
    if (!f) { CHECK(0); return; }
    moetax_report_html_text(f, "a\x7f\x1b<b>&\"'\n\tz\xc3\xa9");
    fclose(f);
    CHECK_MSG(out && !strcmp(out, "a??&lt;b&gt;&amp;&quot;&#39;\n\tz\xc3\xa9"), "%s", out ? out : "(none)");
    free(out);
}

int main(int argc, char **argv) {
    tu_init(argc, argv);
    copies();
    bounds();
    html();
    return tu_finish("test_printable");
}
