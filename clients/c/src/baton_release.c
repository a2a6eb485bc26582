#include <stdio.h>

#include "internal.h"

int baton_release(baton_t *c, unsigned n, const struct timespec *deadline) {
    char request[32], line[BATON_LINE_MAX];
    struct baton_reply r;
    unsigned left = n;
    /* Tokens held through the region go back there first, one at a time,
     * then the socket gives back the rest. More than the connection holds
     * goes to the broker whole: its books count only the socket's tokens,
     * so it refuses (over-release) and nothing was given back anywhere. */
    if (n <= baton_held(c))
        while (left > 0 && c->fast.held > 0 && baton__fast_release(c)) left--;
    if (left == 0 && n > 0) return 0;
    snprintf(request, sizeof request, "RELEASE %u\n", left);
    return baton__call(c, request, "RELEASED", NULL, line, sizeof line, &r, deadline);
}
