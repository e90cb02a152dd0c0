/* report_profile.h - `moetax report` of a routing profile (moetax profile). */
#ifndef MOETAX_TOOLS_REPORT_PROFILE_H
#define MOETAX_TOOLS_REPORT_PROFILE_H

#include <stdbool.h>

#include <jansson.h>

#include "moetax/profile.h"

/* The profile in doc, the JSON document read from path ("-" for stdin): text (or --json) on stdout
 * and optionally the HTML page; the exit code. */
int report_profile(const char *path, const json_t *doc, bool json, const char *html);

#endif
