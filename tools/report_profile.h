/* report_profile.h - `moetax report` of a routing profile (moetax profile). */
#ifndef MOETAX_TOOLS_REPORT_PROFILE_H
#define MOETAX_TOOLS_REPORT_PROFILE_H

#include <stdbool.h>

#include "moetax/profile.h"

/* The profile in text[0..len) (read from path, "-" for stdin): text (or --json) on stdout and
 * optionally the HTML page; the exit code. */
int report_profile(const char *path, const char *text, size_t len, bool json, const char *html);

#endif
