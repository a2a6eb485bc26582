#include <stdio.h>

#include "internal.h"

int baton_release(baton_t *c, unsigned n, const struct timespec *deadline) {
    char request[32], line[BATON_LINE_MAX];
    struct baton_reply r;
    snprintf(request, sizeof request, "RELEASE %u\n", n);
    return baton__call(c, request, "RELEASED", NULL, line, sizeof line, &r, deadline);
}
