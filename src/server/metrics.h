/* server/metrics.h - the scheduler's figures (struct srv_metrics) as Prometheus text. */
#ifndef MOETAX_SERVER_METRICS_H
#define MOETAX_SERVER_METRICS_H

#include <stddef.h>

#include "server/sched.h"

/* malloc'd text, its length in *len; NULL when out of memory. */
char *srv_metrics_text(const struct srv_metrics *m, size_t *len);

#endif
