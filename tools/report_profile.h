/* report_profile.h - `moetax report` of a routing profile (moetax profile). */
#ifndef MOETAX_TOOLS_REPORT_PROFILE_H
#define MOETAX_TOOLS_REPORT_PROFILE_H

#include <stdbool.h>

#include "moetax/profile.h"

/* Text (or --json) on stdout and optionally the HTML page; the exit code. */
int report_profile(const char *path, bool json, const char *html);

#endif
