#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

void baton_close(baton_t *c) {
    if (!c) return;
    if (c->fd >= 0) close(c->fd);
    baton__fast_drop(c);
    free(c);
}
