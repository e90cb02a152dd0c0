/* server/dashboard.h - the self-contained page GET / serves (a prompt box and the live tax). */
#ifndef MOETAX_SERVER_DASHBOARD_H
#define MOETAX_SERVER_DASHBOARD_H

#include <stddef.h>

/* The page (static; not NUL-terminated in *len terms). */
const char *srv_dashboard_html(size_t *len);

#endif
