#include <stdio.h>
#include <string.h>

#include "internal.h"

int baton_try_acquire(baton_t *c, unsigned n, const struct timespec *deadline) {
    char request[32], line[BATON_LINE_MAX];
    struct baton_reply r;
    /* No free token in the region: the pool may have one it was not lent. */
    if (n == 1 && baton__fast_try_acquire(c) == 1) return 1;
    snprintf(request, sizeof request, "TRY %u\n", n);
    if (baton__call(c, request, "GRANTED", "BUSY", line, sizeof line, &r, deadline) < 0) return -1;
    return strcmp(r.kind, "GRANTED") == 0;
}
