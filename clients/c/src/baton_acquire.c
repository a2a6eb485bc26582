#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* After the deadline: CANCEL, and read what comes. The broker answers at
 * once; if the grant won the race, GRANTED comes first and then
 * CANCELLED 0, and the tokens are ours. Returns 1 if granted, 0 if
 * withdrawn, -1 on error. */
static int withdraw(baton_t *c) {
    char line[BATON_LINE_MAX];
    struct baton_reply r;
    if (baton__send(c, "CANCEL\n", 7, NULL) < 0) return -1;
    if (baton__read_reply(c, line, sizeof line, &r, NULL) < 0) return -1;
    int granted = strcmp(r.kind, "GRANTED") == 0;
    if (granted && baton__read_reply(c, line, sizeof line, &r, NULL) < 0) return -1;
    if (strcmp(r.kind, "CANCELLED") != 0) {
        errno = EPROTO;
        baton__say("unexpected reply from the broker: %s where CANCELLED was due", r.kind);
        return -1;
    }
    return granted;
}

int baton_acquire(baton_t *c, unsigned n, const struct timespec *deadline) {
    char request[32], line[BATON_LINE_MAX];
    struct baton_reply r;
    if (n == 1) { /* a seat's region first; what it refuses, the socket does */
        int fast = baton__fast_acquire(c, deadline);
        if (fast != 0) return fast > 0 ? 0 : -1;
    }
    snprintf(request, sizeof request, "ACQUIRE %u\n", n);
    if (baton__send(c, request, strlen(request), deadline) < 0) return -1;
    if (baton__read_reply(c, line, sizeof line, &r, deadline) < 0) {
        if (errno != ETIMEDOUT) return -1;
        int granted = withdraw(c);
        if (granted <= 0) {
            if (granted == 0) {
                errno = ETIMEDOUT;
                baton__say("the deadline passed before the broker granted %u token(s): the request was withdrawn, "
                           "nothing is held for it", n);
            }
            return -1;
        }
        return 0;
    }
    if (strcmp(r.kind, "GRANTED") != 0) {
        errno = EPROTO;
        baton__say("unexpected reply from the broker: %s where GRANTED was due", r.kind);
        return -1;
    }
    return 0;
}
