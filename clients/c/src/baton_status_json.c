#include <errno.h>
#include <stdlib.h>

#include "internal.h"

char *baton_status_json(baton_t *c, const struct timespec *deadline) {
    char line[BATON_LINE_MAX];
    struct baton_reply r;
    if (baton__call(c, "STATUS\n", "STATUS", NULL, line, sizeof line, &r, deadline) < 0) return NULL;
    size_t len = (size_t)r.num[0];
    char *json = malloc(len + 1);
    if (!json) { /* the body stays unread: the connection is unusable (see baton.h) */
        baton__say("out of memory for a status document of %zu bytes", len);
        return NULL;
    }
    if (baton__read_exact(c, json, len + 1, deadline) < 0) {
        int e = errno;
        free(json);
        errno = e;
        return NULL;
    }
    if (json[len] != '\n') {
        free(json);
        errno = EPROTO;
        baton__say("unexpected reply from the broker: a status document not followed by a newline");
        return NULL;
    }
    json[len] = '\0';
    return json;
}
