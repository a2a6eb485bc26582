#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "internal.h"

#define LABEL_MAX 200

/* The label as the broker accepts it: no control characters, at most
 * LABEL_MAX bytes, not cut inside a UTF-8 sequence. */
static void clean_label(const char *label, char *out) {
    const unsigned char *p = (const unsigned char *)(label ? label : "");
    size_t n = 0;
    for (; *p && n < LABEL_MAX; p++)
        if (*p >= 0x20 && *p != 0x7f) out[n++] = (char)*p;
    if (*p) { /* cut short: drop the last UTF-8 sequence, which the cut may have split */
        while (n > 0 && ((unsigned char)out[n - 1] & 0xc0) == 0x80) n--;
        if (n > 0 && ((unsigned char)out[n - 1] & 0xc0) == 0xc0) n--;
    }
    out[n] = '\0';
}

static int open_socket(const char *path) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    strcpy(addr.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    /* A blocking connect: a Unix socket's connect never waits on a network,
     * only, briefly, on a full backlog. */
    while (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        if (errno == EINTR) continue;
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    /* Only our own uid's broker, or root's: a process of another user at
     * the path (a squatted directory, a socket opened to all) could lie
     * about tokens or read our labels (docs/security.md). */
    struct ucred peer = {0};
    socklen_t len = sizeof peer;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    if (peer.uid != getuid() && peer.uid != 0) {
        close(fd);
        errno = EPERM;
        return -1;
    }
    return fd;
}

static int hello(baton_t *c, const char *label, const struct timespec *deadline) {
    char clean[LABEL_MAX + 1], request[LABEL_MAX + 16], line[BATON_LINE_MAX];
    clean_label(label, clean);
    snprintf(request, sizeof request, *clean ? "HELLO 1 %s\n" : "HELLO 1\n", clean);
    struct baton_reply r;
    if (baton__call(c, request, "OK", NULL, line, sizeof line, &r, deadline) < 0) return -1;
    c->limit = (unsigned)r.num[2];
    return 0;
}

baton_t *baton_connect(const char *path, const char *label, const struct timespec *deadline) {
    char resolved[sizeof(((struct sockaddr_un *)0)->sun_path)];
    if (!path) {
        if (baton_socket_path(resolved, sizeof resolved) < 0) return NULL;
        path = resolved;
    }
    baton_t *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->fd = open_socket(path);
    if (c->fd < 0 || hello(c, label, deadline) < 0) {
        int e = errno;
        baton_close(c);
        errno = e;
        return NULL;
    }
    return c;
}
