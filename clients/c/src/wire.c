#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "internal.h"

static const struct {
    const char *code;
    int err;
} refusals[] = {
    {"range", ERANGE},   {"over-release", EINVAL}, {"full", EUSERS},   {"malformed", EPROTO},
    {"too-long", EPROTO}, {"version", EPROTO},      {"hello", EPROTO}, {"busy", EPROTO},
    {"denied", EACCES},  {"unavailable", ENOTSUP},
};

int baton__errno_of(const char *code) {
    for (size_t i = 0; i < sizeof refusals / sizeof *refusals; i++)
        if (strcmp(code, refusals[i].code) == 0) return refusals[i].err;
    return EPROTO;
}

static int replies_of(const char *kind) {
    static const struct {
        const char *kind;
        int count;
    } arity[] = {{"OK", 3}, {"GRANTED", 2}, {"BUSY", 1}, {"RELEASED", 2}, {"CANCELLED", 1}, {"STATUS", 1}, {"LIMIT", 2},
                   {"FASTPATH", 2}};
    for (size_t i = 0; i < sizeof arity / sizeof *arity; i++)
        if (strcmp(kind, arity[i].kind) == 0) return arity[i].count;
    return -1;
}

/* Digits only, at most 20 of them: the protocol's numbers. */
static int parse_number(const char *word, unsigned long long *out) {
    size_t len = strlen(word);
    if (len == 0 || len > 20 || strspn(word, "0123456789") != len) return -1;
    errno = 0;
    *out = strtoull(word, NULL, 10);
    return errno ? -1 : 0;
}

int baton__parse_reply(char *line, struct baton_reply *r) {
    char said[BATON_LINE_MAX];
    snprintf(said, sizeof said, "%s", line); /* for the message: line is cut up below */
    memset(r, 0, sizeof *r);
    char *rest = strchr(line, ' ');
    if (rest) *rest++ = '\0';
    r->kind = line;
    if (strcmp(line, "ERR") == 0) {
        r->code = rest ? rest : "";
        char *space = rest ? strchr(rest, ' ') : NULL;
        if (space) *space++ = '\0';
        r->message = space ? space : "";
        return 0;
    }
    int want = replies_of(line);
    while (rest && r->count < 3) {
        char *word = rest;
        rest = strchr(rest, ' ');
        if (rest) *rest++ = '\0';
        if (parse_number(word, &r->num[r->count]) < 0) break;
        r->count++;
    }
    if (want < 0 || r->count != want || rest) {
        errno = EPROTO;
        baton__say("unexpected reply from the broker: %s", said);
        return -1;
    }
    return 0;
}

static int remaining_ms(const struct timespec *deadline) {
    if (!deadline) return -1;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long long ms = (deadline->tv_sec - now.tv_sec) * 1000LL + (deadline->tv_nsec - now.tv_nsec + 999999) / 1000000;
    if (ms < 0) return 0;
    return ms > 1000000000 ? 1000000000 : (int)ms;
}

int baton__wait(int fd, short events, const struct timespec *deadline) {
    struct pollfd p = {.fd = fd, .events = events};
    for (;;) {
        int n = poll(&p, 1, remaining_ms(deadline));
        if (n > 0) return 0;
        if (n == 0 && remaining_ms(deadline) == 0) {
            errno = ETIMEDOUT;
            baton__say("no answer from the broker before the deadline");
            return -1;
        }
        if (n < 0 && errno != EINTR) {
            baton__say("waiting for the broker: %s", strerror(errno));
            return -1;
        }
    }
}

int baton__send(baton_t *c, const char *data, size_t len, const struct timespec *deadline) {
    while (len > 0) {
        if (baton__wait(c->fd, POLLOUT, deadline) < 0) return -1;
        ssize_t n = send(c->fd, data, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            if (errno == EPIPE) errno = ECONNRESET;
            if (errno == ECONNRESET)
                baton__say("the broker closed the connection");
            else
                baton__say("writing to the broker: %s", strerror(errno));
            return -1;
        }
        data += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Reads what has arrived into c->buf, waiting until the deadline. */
static int fill(baton_t *c, const struct timespec *deadline) {
    if (c->len == sizeof c->buf) {
        errno = EPROTO;
        baton__say("unexpected reply from the broker: %zu bytes without a newline", c->len);
        return -1;
    }
    for (;;) {
        if (baton__wait(c->fd, POLLIN, deadline) < 0) return -1;
        ssize_t n = recv(c->fd, c->buf + c->len, sizeof c->buf - c->len, MSG_DONTWAIT);
        if (n > 0) {
            c->len += (size_t)n;
            return 0;
        }
        if (n == 0) errno = ECONNRESET;
        if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
            if (errno == ECONNRESET)
                baton__say("the broker closed the connection");
            else
                baton__say("reading from the broker: %s", strerror(errno));
            return -1;
        }
    }
}

static void consume(baton_t *c, size_t n) {
    memmove(c->buf, c->buf + n, c->len - n);
    c->len -= n;
}

int baton__read_line(baton_t *c, char *line, size_t size, const struct timespec *deadline) {
    char *end;
    while (!(end = memchr(c->buf, '\n', c->len)))
        if (fill(c, deadline) < 0) return -1;
    size_t len = (size_t)(end - c->buf);
    if (len >= size) {
        errno = EPROTO;
        baton__say("unexpected reply from the broker: a line of %zu bytes", len);
        return -1;
    }
    memcpy(line, c->buf, len);
    line[len] = '\0';
    consume(c, len + 1);
    return (int)len;
}

int baton__read_exact(baton_t *c, char *out, size_t len, const struct timespec *deadline) {
    while (len > 0) {
        if (c->len == 0 && fill(c, deadline) < 0) return -1;
        size_t n = c->len < len ? c->len : len;
        memcpy(out, c->buf, n);
        consume(c, n);
        out += n;
        len -= n;
    }
    return 0;
}

int baton__read_reply(baton_t *c, char *line, size_t size, struct baton_reply *r, const struct timespec *deadline) {
    if (baton__read_line(c, line, size, deadline) < 0) return -1;
    if (baton__parse_reply(line, r) < 0) return -1;
    if (strcmp(r->kind, "ERR") == 0) {
        snprintf(c->refusal, sizeof c->refusal, "%s (%s)", r->message, r->code);
        errno = baton__errno_of(r->code);
        baton__say("broker refused: %s", c->refusal);
        return -1;
    }
    if (strcmp(r->kind, "GRANTED") == 0 || strcmp(r->kind, "RELEASED") == 0) c->held = (unsigned)r->num[1];
    return 0;
}

int baton__call(baton_t *c, const char *request, const char *want, const char *also, char *line, size_t size,
                struct baton_reply *r, const struct timespec *deadline) {
    /* A broker that turned us away (ERR full, at connect) may have closed
     * before the request went out: its reply is still there to read. */
    if (baton__send(c, request, strlen(request), deadline) < 0 && errno != ECONNRESET) return -1;
    if (baton__read_reply(c, line, size, r, deadline) < 0) return -1;
    if (strcmp(r->kind, want) != 0 && !(also && strcmp(r->kind, also) == 0)) {
        errno = EPROTO;
        baton__say("unexpected reply from the broker: %s where %s was due", r->kind, want);
        return -1;
    }
    return 0;
}
