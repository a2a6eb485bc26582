#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

void baton_close(baton_t *c) {
    if (!c) return;
    if (c->fd >= 0) close(c->fd);
    free(c);
}
